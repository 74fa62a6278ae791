"""A GPT in Flax NNX, its layers stacked for a scan and for pipeline stages.

Like microsoft/dion's ``models/gpt_model.py``: pre-norm RMSNorm, rotary embeddings,
QK-norm, causal attention, ReLU² MLP, untied embedding and LM head, no biases. Query,
key and value are three kernels, so Dion orthonormalizes each as its own matrix.
:class:`GPTConfig`'s options make the same model Llama 3 or Qwen3: grouped-query
attention (N query heads share K key/value heads), a SwiGLU MLP (``gate``, ``up``,
``down``), learnable QK-norm scales, a tied LM head.

NNX modules define the parameters and one layer's math. Training works on the pure
dict of arrays (``nnx.split`` then ``to_pure_dict``), which optax, Dion's labels and
Orbax take as they are; ``models.loss`` (``models/lm_loss.py``) merges it back with the
graph definition:

    graphdef, params = models.init(cfg, par, seed=0)     # params: nested dict of arrays
    loss = models.loss(graphdef, params, batch, par)     # batch: "inputs", "targets" [B, T]

Parameter tree (Flax layout, blocks stacked ``(stages, layers_per_stage, ...)``)::

    embed/embedding                 [V, D]
    blocks/attn_norm/scale          [S, Ls, D]
    blocks/attn/query/kernel        [S, Ls, D, N·H]    column-parallel
    blocks/attn/{key,value}/kernel  [S, Ls, D, K·H]    column-parallel (K = N without GQA)
    blocks/attn/{query,key}_norm/scale  [S, Ls, H]     qk_norm="rms_scale" only
    blocks/attn/out/kernel          [S, Ls, N·H, D]    row-parallel
    blocks/mlp_norm/scale           [S, Ls, D]
    blocks/mlp/{gate,up}/kernel     [S, Ls, D, F]      column-parallel (gate: swiglu only)
    blocks/mlp/down/kernel          [S, Ls, F, D]      row-parallel
    blocks/mlp/...                  a mixture of experts instead (``models/moe.py``)
    final_norm/scale                [D]
    lm_head/kernel                  [D, V]             vocab-parallel (absent when tied)

H = head_dim (D / N by default), F = d_mlp (4D by default).

With experts on every n-th layer only (``moe_every`` = n > 1) the stack's unit is a
:class:`Group` of n layers, ``[S, Gs, ...]`` with Gs = Ls / n groups per stage: its n − 1
dense layers under ``blocks/dense/...`` ``[S, Gs, n − 1, ...]``, then its mixture-of-experts
layer under ``blocks/moe/...`` ``[S, Gs, ...]``, each with the leaves above.

Parallelism is in ``models/sharding.py`` (TP, SP, FS by annotation),
``models/pipeline.py`` (PP by ``shard_map``) and ``models/context.py`` (CP by ``shard_map``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from dion_jax import parallel
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import context, moe, pipeline, remat
from models.config import GPTConfig
from models.layers import MLP, Dense, embedding_lookup, rms_norm
from models.lm_head import head_terms, vocab_logits
from models.sharding import Parallelism, param_specs, shardings, to_stages


class Attention(nnx.Module):
  """Causal self-attention with rotary embeddings, optional QK-norm and grouped-query
  attention; query and key/value heads split over tp."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    d, h, fp8 = cfg.d_model, cfg.head_dim, cfg.fp8
    self.query = Dense(d, cfg.num_heads * h, "column", fp8=fp8, rngs=rngs)
    self.key = Dense(d, cfg.kv_heads * h, "column", fp8=fp8, rngs=rngs)
    self.value = Dense(d, cfg.kv_heads * h, "column", fp8=fp8, rngs=rngs)
    self.out = Dense(cfg.num_heads * h, d, "row", fp8=fp8, rngs=rngs)
    if cfg.qk_norm == "rms_scale":
      self.query_norm = nnx.RMSNorm(h, epsilon=cfg.norm_eps, rngs=rngs)
      self.key_norm = nnx.RMSNorm(h, epsilon=cfg.norm_eps, rngs=rngs)
    self.cfg = cfg

  def _qk(self, z_BxTxNxH: jax.Array, norm: str, rope) -> jax.Array:
    qk_norm, eps = self.cfg.qk_norm, self.cfg.norm_eps
    if qk_norm == "rms":  # rotary first, then the unscaled norm, as the reference orders them
      return rms_norm(_rotary(z_BxTxNxH, *rope), eps)
    if qk_norm == "rms_scale":  # the scale is per dimension: it must come before the rotation
      z_BxTxNxH = getattr(self, norm)(z_BxTxNxH).astype(z_BxTxNxH.dtype)
    return _rotary(z_BxTxNxH, *rope)

  def _heads(self, x_BxTxD: jax.Array, rope, par: Parallelism) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries [B, T, N, H] and keys [B, T, K, H], normed and rotated, and values [B, T, K, H]."""
    B, T, _ = x_BxTxD.shape
    H = self.cfg.head_dim

    def heads(dense, name):
      z = dense(x_BxTxD, par)
      return checkpoint_name(par.constrain(z.reshape(B, T, z.shape[-1] // H, H), "batch", None, "heads", None), name)

    return (self._qk(heads(self.query, "query_proj"), "query_norm", rope),
            self._qk(heads(self.key, "key_proj"), "key_norm", rope), heads(self.value, "value_proj"))

  def __call__(self, x_BxTxD: jax.Array, rope: tuple[jax.Array, jax.Array], par: Parallelism,
               segment_ids_BxT: jax.Array | None = None, logit_max: bool = False
               ) -> tuple[jax.Array, jax.Array | None]:
    """The attention's output [B, T, D], and with ``logit_max`` each query head's largest
    pre-softmax logit [N] (else None)."""
    B, T, _ = x_BxTxD.shape
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = self._heads(x_BxTxD, rope, par)
    dtype = v_BxTxKxH.dtype
    if self.cfg.attention == "xla" and dtype == jnp.float16:
      # XLA's attention asks float16 dots for float32 results (F16_F16_F32), which the
      # CPU's dot_general refuses at compile time: run it in float32 (its softmax is anyway).
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (t.astype(jnp.float32) for t in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))
    kv_spec = None if par.mesh is None else par.spec("batch", None, "heads", None)
    o_BxTxNxH = context.attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, implementation=self.cfg.attention,
                                  cp=par.cp, segment_ids_BxT=segment_ids_BxT, spec=kv_spec)
    o_BxTxNxH = par.constrain(o_BxTxNxH.astype(dtype), "batch", None, "heads", None)
    out = checkpoint_name(self.out(checkpoint_name(o_BxTxNxH.reshape(B, T, -1), "attention_out"), par), "out_proj")
    if not logit_max:
      return out, None
    return out, context.logit_max(q_BxTxNxH, k_BxTxKxH, cp=par.cp, segment_ids_BxT=segment_ids_BxT, spec=kv_spec)

  def cached(self, x_BxTxD: jax.Array, rope, par: Parallelism, cache: KVCache
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Attention of T new tokens to the cache (``models/generate.py``): their keys and
    values written at slots ``[cache.start, cache.start + T)`` of the layer's cache, each
    query attending to the slots ``cache.visible`` marks. Returns the output [B, T, D] and
    the new keys and values [B, T, K, H], which the caller stores in its cache."""
    B, T, _ = x_BxTxD.shape
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = self._heads(x_BxTxD, rope, par)
    dtype = v_BxTxKxH.dtype
    k_BxSxKxH = jax.lax.dynamic_update_slice_in_dim(cache.k_BxSxKxH, k_BxTxKxH.astype(cache.k_BxSxKxH.dtype),
                                                    cache.start, axis=1)
    v_BxSxKxH = jax.lax.dynamic_update_slice_in_dim(cache.v_BxSxKxH, v_BxTxKxH.astype(cache.v_BxSxKxH.dtype),
                                                    cache.start, axis=1)
    if dtype == jnp.float16:  # as in __call__: the CPU's dot refuses float16 -> float32
      q_BxTxNxH, k_BxSxKxH, v_BxSxKxH = (t.astype(jnp.float32) for t in (q_BxTxNxH, k_BxSxKxH, v_BxSxKxH))
    o_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH.astype(q_BxTxNxH.dtype),
                                             v_BxSxKxH.astype(q_BxTxNxH.dtype),
                                             mask=cache.visible_BxTxS[:, None], implementation="xla")
    out = self.out(o_BxTxNxH.astype(dtype).reshape(B, T, -1), par)
    return out, (k_BxTxKxH, v_BxTxKxH)


class KVCache(NamedTuple):
  """One layer's cache as :meth:`Attention.cached` reads it.

  Attributes:
    k_BxSxKxH, v_BxSxKxH: keys and values of the S slots (those not yet written are ignored).
    start: int scalar, the slot of the first of this call's T tokens.
    visible_BxTxS: bool, which slots each of the T new tokens attends to (itself included).
  """
  k_BxSxKxH: jax.Array
  v_BxSxKxH: jax.Array
  start: jax.Array
  visible_BxTxS: jax.Array


def _rotary(x_BxTxNxH: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates each pair (x[i], x[i + H/2]) by minus the angle, as the reference does (Hugging
  Face rotates by plus the angle: ``models/hf.py`` flips signs of the kernels to match)."""
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[..., None, :], sin[..., None, :]  # over heads
  return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1).astype(x_BxTxNxH.dtype)


def rotary_tables(cfg: GPTConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles at ``positions`` (int [T], or [B, T] for packed
  sequences), [..., head_dim / 2] in float32."""
  half = cfg.head_dim // 2
  inv_freq_H2 = 1.0 / cfg.rope_base ** (jnp.arange(half, dtype=jnp.float32) / half)
  if cfg.rope_llama3 is not None:
    inv_freq_H2 = _llama3_frequencies(inv_freq_H2, *cfg.rope_llama3)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq_H2
  return jnp.cos(angles), jnp.sin(angles)


def _llama3_frequencies(inv_freq: jax.Array, factor: float, low: float, high: float,
                        context: int) -> jax.Array:
  """Llama 3.1's scaling: wavelengths beyond ``context / low`` slowed by ``factor``, those
  below ``context / high`` kept, the ones between interpolated smoothly."""
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
  smooth = (context / wavelen - low) / (high - low)
  medium = (wavelen >= context / high) & (wavelen <= context / low)
  return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class Block(nnx.Module):
  """One pre-norm transformer layer, its MLP dense or (``experts``) a mixture of experts.
  The residual stream stays float32."""

  def __init__(self, cfg: GPTConfig, experts: bool, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
    self.mlp = moe.MoE(cfg, rngs=rngs) if experts else MLP(cfg, rngs=rngs)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x_BxTxD: jax.Array, rope, par: Parallelism,
               segment_ids_BxT: jax.Array | None = None, logit_max: bool = False,
               cache: KVCache | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """The layer's output and its aux: ``"logit_max"``, the attention's logit maxima [N]
    (with ``logit_max``), ``"router"``, the MoE's :class:`models.moe.RouterStats`, and with
    a ``cache`` (:meth:`Attention.cached`) ``"kv"``, the new tokens' keys and values."""
    # With SP the norms run on sequence shards; the constraint to a full sequence before
    # each column-parallel product is the all-gather, the one after each row-parallel
    # product the reduce-scatter.
    aux = {}
    x_BxTxD = checkpoint_name(x_BxTxD, "layer_input")
    h = par.constrain(self.attn_norm(x_BxTxD).astype(self.dtype), "batch", None, None)
    if cache is None:
      attn, logits_N = self.attn(h, rope, par, segment_ids_BxT, logit_max)
    else:
      attn, aux["kv"] = self.attn.cached(h, rope, par, cache)
    if logit_max:
      aux["logit_max"] = logits_N
    x_BxTxD += par.constrain(attn.astype(jnp.float32), "batch", "seq", None)
    h = par.constrain(self.mlp_norm(x_BxTxD).astype(self.dtype), "batch", None, None)
    mlp = self.mlp(h, par)
    if isinstance(self.mlp, moe.MoE):
      mlp, aux["router"] = mlp
    return x_BxTxD + par.constrain(mlp.astype(jnp.float32), "batch", "seq", None), aux


def _stack(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
  """``n`` modules from ``make``, each with its own random draws, stacked on a leading axis."""
  return nnx.split_rngs(splits=n)(nnx.vmap(make, in_axes=(0,), out_axes=0))(rngs)


class Group(nnx.Module):
  """``moe_every`` consecutive layers, the unit of the layer stack when mixtures of experts
  alternate with dense layers: ``moe_every − 1`` dense :class:`Block` s stacked under
  ``dense`` (leading axis), then one mixture-of-experts :class:`Block`, ``moe``."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.dense = _stack(lambda r: Block(cfg, experts=False, rngs=r), cfg.moe_every - 1, rngs)
    self.moe = Block(cfg, experts=True, rngs=rngs)

  def __call__(self, x_BxTxD: jax.Array, rope, par: Parallelism,
               segment_ids_BxT: jax.Array | None = None, logit_max: bool = False,
               cache: KVCache | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """The layers in order; aux as :class:`Block`'s, its ``"logit_max"`` [moe_every, N] in
    layer order, its ``"router"`` the mixture's. A ``cache`` holds the group's layers'
    keys and values [moe_every, B, S, K, H]; ``"kv"`` is then [moe_every, B, T, K, H]."""

    def layer_cache(j):
      return None if cache is None else cache._replace(k_BxSxKxH=cache.k_BxSxKxH[j], v_BxSxKxH=cache.v_BxSxKxH[j])

    graphdef, dense = nnx.split(self.dense)
    maxima, kvs = [], []
    n = jax.tree.leaves(dense)[0].shape[0]
    for j in range(n):  # a few layers: traced one by one
      block = nnx.merge(graphdef, jax.tree.map(lambda stack, j=j: stack[j], dense))
      x_BxTxD, aux = block(x_BxTxD, rope, par, segment_ids_BxT, logit_max, layer_cache(j))
      maxima.append(aux.get("logit_max"))
      kvs.append(aux.get("kv"))
    x_BxTxD, aux = self.moe(x_BxTxD, rope, par, segment_ids_BxT, logit_max, layer_cache(n))
    if logit_max:
      aux["logit_max"] = jnp.stack([*maxima, aux["logit_max"]])
    if cache is not None:
      aux["kv"] = jax.tree.map(lambda *layers: jnp.stack(layers), *kvs, aux["kv"])
    return x_BxTxD, aux


class GPT(nnx.Module):
  """Embedding, ``num_layers`` stacked :class:`Block` s (leading layer axis; :class:`Group` s of
  ``moe_every`` layers when experts are on every n-th layer), final norm, LM head (the
  embedding's transpose when ``tie_embeddings``)."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    V, D = cfg.padded_vocab, cfg.d_model
    self.embed = nnx.Embed(V, D, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    if cfg.group_size > 1:
      unit = lambda r: Group(cfg, rngs=r)
    else:
      unit = lambda r: Block(cfg, experts=bool(cfg.num_experts), rngs=r)
    self.blocks = _stack(unit, cfg.num_layers // cfg.group_size, rngs)
    self.final_norm = nnx.RMSNorm(D, epsilon=cfg.norm_eps, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = Dense(D, V, "column", rngs=rngs)

  def embed_tokens(self, tokens_BxT: jax.Array, par: Parallelism) -> jax.Array:
    table_VxD = par.weight(self.embed.embedding[...], "row")
    return par.constrain(embedding_lookup(table_VxD, tokens_BxT, par), "batch", "seq", None)

  def normed(self, x_BxTxD: jax.Array, par: Parallelism) -> jax.Array:
    """The final norm of the residual stream, in the compute dtype, the sequence whole."""
    return par.constrain(self.final_norm(x_BxTxD).astype(self.cfg.dtype), "batch", None, None)

  def head(self, par: Parallelism) -> jax.Array:
    """The LM head [D, padded vocab], float32, vocab-parallel over tp, gathered over fs
    (the embedding's transpose when ``tie_embeddings``)."""
    if self.cfg.tie_embeddings:
      return par.weight(self.embed.embedding[...], "row").T
    return par.weight(self.lm_head.kernel[...], "column")

  def logits(self, x_BxTxD: jax.Array, par: Parallelism) -> jax.Array:
    """Final norm and LM head: float32 logits [B, T, padded vocab], vocab-parallel over tp;
    -inf on the padding rows with ``mask_vocab_padding``. (The losses never form them
    whole: :meth:`token_losses`.)"""
    return vocab_logits(self.normed(x_BxTxD, par), self.head(par), par, self._masked_vocab)

  def token_losses(self, x_BxTxD: jax.Array, targets_BxT: jax.Array, par: Parallelism) -> jax.Array:
    """Cross-entropy of each position [B, T], float32, ``loss_chunk`` tokens at a time,
    never gathering the vocabulary (``models/lm_head.py``; a target -1 gives the
    log-sum-exp alone: the caller leaves it out)."""
    terms = head_terms(self.normed(x_BxTxD, par), self.head(par), targets_BxT, par,
                       vocab_size=self._masked_vocab, chunk=self.cfg.loss_chunk)
    return terms.normalizer - terms.target

  @property
  def _masked_vocab(self) -> int | None:
    return self.cfg.vocab_size if self.cfg.mask_vocab_padding else None


def apply_layers(block_graphdef: Any, layers: Any, x_BxTxD: jax.Array, rope,
                 par: Parallelism, cfg: GPTConfig, segment_ids_BxT: jax.Array | None = None,
                 logit_max: bool = False) -> Any:
  """Runs the layers ``layers`` (leaves [L, ...], in order; [L / moe_every, ...] groups when
  ``cfg.group_size`` > 1) over ``x`` with a scan; returns ``(x, aux)``, aux the units'
  :class:`Block` (:class:`Group`) aux stacked ``[L, ...]`` (``[L / moe_every, ...]``).

  The backward pass keeps what ``cfg.remat``'s policy names (``models/remat.py``) and
  recomputes the rest: each layer's parameters are sliced from the stack inside the
  checkpointed body, so their fs-gathered copies are gathered again in the backward pass
  instead of being kept for all layers at once (ZeRO-3).
  """

  def layer(x, i):
    params = jax.tree.map(lambda stack: stack[i], layers)
    return nnx.merge(block_graphdef, params)(x, rope, par, segment_ids_BxT, logit_max)

  layer = jax.checkpoint(layer, policy=remat.policy(cfg.remat))
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  nested = bool(jax.sharding.get_abstract_mesh().manual_axes)
  return pipeline.scan(layer, x_BxTxD, num_layers, cfg.unroll, python_loop=bool(cfg.num_experts) and nested)


def _create(cfg: GPTConfig, par: Parallelism, seed: int) -> Callable[[], Any]:
  def create():
    params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(seed))))
    params["blocks"] = to_stages(params["blocks"], par.pp, par.virtual_stages)
    return params

  return create


def abstract(cfg: GPTConfig, par: Parallelism = Parallelism()) -> tuple[Any, Any]:
  """``(graphdef, shapes)``: the GPT's graph and its parameters as ``ShapeDtypeStruct`` s
  carrying their shardings on ``par.mesh`` (none without a mesh), blocks in stages.

  Checks that the mesh divides the model (heads, key/value heads, every sharded dimension).
  """
  units, stages = cfg.num_layers // cfg.group_size, par.pp * par.virtual_stages
  if units % stages:
    grouped = f" (in groups of moe_every={cfg.group_size})" if cfg.group_size > 1 else ""
    raise ValueError(f"{cfg.num_layers} layers{grouped} do not split into {stages} pipeline stages"
                     f" (pp={par.pp} x virtual_stages={par.virtual_stages}); choose sizes that divide")
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
  shapes = jax.eval_shape(_create(cfg, par, 0))
  if par.mesh is None:
    return graphdef, shapes
  if cfg.num_heads % par.tp or cfg.kv_heads % par.tp:
    raise ValueError(f"tp={par.tp} does not divide num_heads={cfg.num_heads} and num_kv_heads="
                     f"{cfg.kv_heads}; choose a tp that divides both (heads are split over tp)")
  specs = param_specs(shapes)
  parallel.tree_check_divisible(shapes, specs, par.mesh)
  return graphdef, jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                shapes, shardings(par.mesh, specs))


def init(cfg: GPTConfig, par: Parallelism = Parallelism(), seed: int = 0) -> tuple[Any, Any]:
  """Creates the GPT: ``(graphdef, params)``, params a pure dict sharded on ``par.mesh``.

  Layers are drawn in layer order from ``seed`` and then stacked into ``par``'s stages,
  so every mesh starts from the same model.
  """
  graphdef, shapes = abstract(cfg, par)
  if par.mesh is None:
    return graphdef, jax.jit(_create(cfg, par, seed))()
  out_shardings = jax.tree.map(lambda s: s.sharding, shapes)
  return graphdef, jax.jit(_create(cfg, par, seed), out_shardings=out_shardings)()
