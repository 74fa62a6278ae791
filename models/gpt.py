"""A GPT in Flax NNX, its layers stacked for a scan and for pipeline stages.

Like microsoft/dion's ``models/gpt_model.py``: pre-norm RMSNorm, rotary embeddings,
QK-norm, causal attention, ReLU² MLP, untied embedding and LM head, no biases. Query,
key and value are three kernels, so Dion orthonormalizes each as its own matrix.

NNX modules define the parameters and one layer's math. Training works on the pure
dict of arrays (``nnx.split`` then ``to_pure_dict``), which optax, Dion's labels and
Orbax take as they are; :func:`loss` merges it back with the graph definition:

    graphdef, params = models.init(cfg, par, seed=0)     # params: nested dict of arrays
    loss = models.loss(graphdef, params, batch, par)     # batch: "inputs", "targets" [B, T]

Parameter tree (Flax layout, blocks stacked ``(stages, layers_per_stage, ...)``)::

    embed/embedding                 [V, D]
    blocks/attn_norm/scale          [S, Ls, D]
    blocks/attn/{query,key,value}   [S, Ls, D, D]      column-parallel
    blocks/attn/out/kernel          [S, Ls, D, D]      row-parallel
    blocks/mlp_norm/scale           [S, Ls, D]
    blocks/mlp/up/kernel            [S, Ls, D, 4D]     column-parallel
    blocks/mlp/down/kernel          [S, Ls, 4D, D]     row-parallel
    final_norm/scale                [D]
    lm_head/kernel                  [D, V]             vocab-parallel

Parallelism is in ``models/sharding.py`` (TP, SP, FS by annotation),
``models/pipeline.py`` (PP by ``shard_map``) and ``models/context.py`` (CP by ``shard_map``).
"""
from __future__ import annotations

import functools
import math
from typing import Any

from dion_jax import parallel
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import context, pipeline
from models.config import GPTConfig
from models.sharding import Parallelism, param_specs, shardings, to_layers, to_stages

_NORM_EPS = 1e-6


def _rms_norm(x: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + _NORM_EPS)).astype(x.dtype)


class Dense(nnx.Module):
  """A bias-free kernel (fan_in, fan_out), column- or row-parallel.

  Initialized N(0, σ²) with σ = min(1, sqrt(fan_out/fan_in)) / sqrt(fan_in)
  (arXiv 2310.17813, as the reference).
  """

  def __init__(self, fan_in: int, fan_out: int, layout: str, *, rngs: nnx.Rngs):
    std = min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)
    self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (fan_in, fan_out), jnp.float32))
    self.layout = layout

  def __call__(self, x: jax.Array, par: Parallelism) -> jax.Array:
    return x @ par.weight(self.kernel[...], self.layout).astype(x.dtype)


class Attention(nnx.Module):
  """Causal self-attention with rotary embeddings and QK-norm; heads split over tp."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    self.query = Dense(d, d, "column", rngs=rngs)
    self.key = Dense(d, d, "column", rngs=rngs)
    self.value = Dense(d, d, "column", rngs=rngs)
    self.out = Dense(d, d, "row", rngs=rngs)
    self.num_heads = cfg.num_heads
    self.implementation = cfg.attention

  def __call__(self, x_BxTxD: jax.Array, rope: tuple[jax.Array, jax.Array],
               par: Parallelism) -> jax.Array:
    B, T, D = x_BxTxD.shape
    N = self.num_heads

    def heads(dense):
      return par.constrain(dense(x_BxTxD, par).reshape(B, T, N, D // N), "batch", None, "heads", None)

    # Rotary first, then QK-norm, as the reference orders them.
    q_BxTxNxH = _rms_norm(_rotary(heads(self.query), *rope))
    k_BxTxNxH = _rms_norm(_rotary(heads(self.key), *rope))
    v_BxTxNxH = heads(self.value)
    dtype = v_BxTxNxH.dtype
    if self.implementation == "xla" and dtype == jnp.float16:
      # XLA's attention asks float16 dots for float32 results (F16_F16_F32), which the
      # CPU's dot_general refuses at compile time: run it in float32 (its softmax is anyway).
      q_BxTxNxH, k_BxTxNxH, v_BxTxNxH = (t.astype(jnp.float32) for t in (q_BxTxNxH, k_BxTxNxH, v_BxTxNxH))
    o_BxTxNxH = context.attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, implementation=self.implementation,
                                  cp=par.cp)
    o_BxTxNxH = par.constrain(o_BxTxNxH.astype(dtype), "batch", None, "heads", None)
    return self.out(o_BxTxNxH.reshape(B, T, D), par)


def _rotary(x_BxTxNxH: jax.Array, cos_TxH2: jax.Array, sin_TxH2: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_TxH2[:, None, :], sin_TxH2[:, None, :]
  return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1).astype(x_BxTxNxH.dtype)


def rotary_tables(cfg: GPTConfig, positions_T: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles at ``positions`` (int [T]), [T, head_dim / 2] in float32."""
  half = cfg.head_dim // 2
  inv_freq_H2 = 1.0 / cfg.rope_base ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles_TxH2 = positions_T.astype(jnp.float32)[:, None] * inv_freq_H2[None, :]
  return jnp.cos(angles_TxH2), jnp.sin(angles_TxH2)


class MLP(nnx.Module):
  """Column-parallel up, ReLU², row-parallel down."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.up = Dense(cfg.d_model, cfg.d_mlp, "column", rngs=rngs)
    self.down = Dense(cfg.d_mlp, cfg.d_model, "row", rngs=rngs)

  def __call__(self, x_BxTxD: jax.Array, par: Parallelism) -> jax.Array:
    h_BxTxF = par.constrain(self.up(x_BxTxD, par), "batch", None, "mlp")
    return self.down(jnp.square(jax.nn.relu(h_BxTxF)), par)


class Block(nnx.Module):
  """One pre-norm transformer layer. The residual stream stays float32."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=_NORM_EPS, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=_NORM_EPS, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x_BxTxD: jax.Array, rope, par: Parallelism) -> jax.Array:
    # With SP the norms run on sequence shards; the constraint to a full sequence before
    # each column-parallel product is the all-gather, the one after each row-parallel
    # product the reduce-scatter.
    h = par.constrain(self.attn_norm(x_BxTxD).astype(self.dtype), "batch", None, None)
    x_BxTxD += par.constrain(self.attn(h, rope, par).astype(jnp.float32), "batch", "seq", None)
    h = par.constrain(self.mlp_norm(x_BxTxD).astype(self.dtype), "batch", None, None)
    return x_BxTxD + par.constrain(self.mlp(h, par).astype(jnp.float32), "batch", "seq", None)


class GPT(nnx.Module):
  """Embedding, ``num_layers`` stacked :class:`Block` s (leading layer axis), final norm, LM head."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    V, D = cfg.padded_vocab, cfg.d_model
    self.embed = nnx.Embed(V, D, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
      return Block(cfg, rngs=rngs)

    self.blocks = stack(rngs)
    self.final_norm = nnx.RMSNorm(D, epsilon=_NORM_EPS, rngs=rngs)
    self.lm_head = Dense(D, V, "column", rngs=rngs)

  def embed_tokens(self, tokens_BxT: jax.Array, par: Parallelism) -> jax.Array:
    table_VxD = par.weight(self.embed.embedding[...], "row")
    return par.constrain(jnp.take(table_VxD, tokens_BxT, axis=0), "batch", "seq", None)

  def token_losses(self, x_BxTxD: jax.Array, targets_BxT: jax.Array, par: Parallelism) -> jax.Array:
    """Cross-entropy of each position [B, T], float32, never gathering the vocabulary.

    The logits stay vocab-parallel over tp: the log-sum-exp and the target's logit
    (a one-hot contraction, not a gather) reduce over tp as [B, T] partial results.
    """
    h = par.constrain(self.final_norm(x_BxTxD).astype(self.cfg.dtype), "batch", None, None)
    logits_BxTxV = par.constrain(self.lm_head(h, par).astype(jnp.float32), "batch", None, "vocab")
    onehot_BxTxV = jax.nn.one_hot(targets_BxT, logits_BxTxV.shape[-1], dtype=jnp.float32)
    onehot_BxTxV = par.constrain(onehot_BxTxV, "batch", None, "vocab")
    target_logit_BxT = jnp.sum(logits_BxTxV * onehot_BxTxV, -1)
    return jax.nn.logsumexp(logits_BxTxV, -1) - target_logit_BxT


def apply_layers(block_graphdef: Any, layers: Any, x_BxTxD: jax.Array, rope,
                 par: Parallelism, cfg: GPTConfig) -> jax.Array:
  """Runs the layers ``layers`` (leaves [L, ...], in order) over ``x`` with a scan.

  The backward pass keeps only matrix products (``dots_saveable``; nothing with
  ``remat``): each layer's parameters are sliced from the stack inside the checkpointed
  body, so their fs-gathered copies are gathered again in the backward pass instead of
  being kept for all layers at once (ZeRO-3).
  """

  def layer(x, i):
    params = jax.tree.map(lambda stack: stack[i], layers)
    return nnx.merge(block_graphdef, params)(x, rope, par), None

  policies = jax.checkpoint_policies
  policy = policies.nothing_saveable if cfg.remat else policies.dots_saveable
  layer = jax.checkpoint(layer, policy=policy)
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  return jax.lax.scan(layer, x_BxTxD, jnp.arange(num_layers), unroll=cfg.unroll)[0]


def init(cfg: GPTConfig, par: Parallelism = Parallelism(), seed: int = 0) -> tuple[Any, Any]:
  """Creates the GPT: ``(graphdef, params)``, params a pure dict sharded on ``par.mesh``.

  Layers are drawn in layer order from ``seed`` and then stacked into ``par``'s stages,
  so every mesh starts from the same model.
  """
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(seed))))

  def create():
    params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(seed))))
    params["blocks"] = to_stages(params["blocks"], par.pp, par.virtual_stages)
    return params

  if par.mesh is None:
    return graphdef, jax.jit(create)()
  if cfg.num_heads % par.tp:
    raise ValueError(f"tp={par.tp} does not divide num_heads={cfg.num_heads}; choose a tp that divides it")
  specs = param_specs(jax.eval_shape(create))
  parallel.tree_check_divisible(jax.eval_shape(create), specs, par.mesh)
  return graphdef, jax.jit(create, out_shardings=shardings(par.mesh, specs))()


def loss(graphdef: Any, params: Any, batch: dict[str, jax.Array], par: Parallelism = Parallelism(),
         scale: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross-entropy of ``batch`` ("inputs", "targets": int [B, T]), times
  ``scale`` when given.

  With pp > 1 the batch is split into ``par.microbatches`` micro-batches that flow
  through the pipeline; otherwise the whole batch goes through the layer scan at once.
  With cp > 1 every sequence is split over cp (``models/context.py``).
  On a mesh, call it under ``jax.set_mesh(par.mesh)``.

  ``scale`` is a float16 run's loss scale: it multiplies the loss here, not in the
  caller, because the pipeline takes its gradient inside its ``shard_map``, and the
  float16 backward pass must see the scaled cotangent there.
  """
  if par.mesh is not None and jax.sharding.get_abstract_mesh().empty:
    raise ValueError("models.loss on a mesh must run under `with jax.set_mesh(par.mesh):`")
  if par.pp > 1 or par.cp > 1:
    return _manual_loss(graphdef, params, batch, scale, par)
  model = nnx.merge(graphdef, params)
  rope = rotary_tables(model.cfg, jnp.arange(batch["inputs"].shape[1]))
  layers = to_layers(params["blocks"], 1)
  x = model.embed_tokens(batch["inputs"], par)
  x = apply_layers(nnx.graphdef(model.blocks), layers, x, rope, par, model.cfg)
  return _scaled(jnp.mean(model.token_losses(x, batch["targets"], par)), scale)


def _scaled(loss: jax.Array, scale: jax.Array | None) -> jax.Array:
  return loss if scale is None else loss * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _manual_loss(graphdef: Any, params: Any, batch: dict[str, jax.Array], scale: jax.Array | None,
                 par: Parallelism) -> jax.Array:
  """:func:`loss` in a ``shard_map`` manual over ``pp`` and ``cp`` (those of size > 1; the
  other axes left to the partitioner).

  With pp > 1 the layers run in a pipeline over pp. Embedding, final norm, LM head and
  loss run inside the same ``shard_map``: device 0 embeds each micro-batch as it enters,
  and the last stage's outputs are scattered over pp so that each device computes the
  loss of M/pp micro-batches. With cp > 1 each rank holds T/cp tokens of every sequence
  in ``context``'s balanced layout; the parameters are the same on every cp rank, so
  their gradients are summed over cp, as over data-parallel ranks.

  The gradient is taken inside the ``shard_map`` and handed out by this ``custom_vjp``:
  on jax 0.10 differentiating a ``shard_map`` nested in another one (the per-replica
  gradient's, manual over rp) fails to lower, while this form nests at any depth.
  """
  return _manual_call(graphdef, params, batch, scale, par, with_grad=False)


def _manual_fwd(graphdef, params, batch, scale, par):
  return _manual_call(graphdef, params, batch, scale, par, with_grad=True)


def _manual_bwd(graphdef, par, grads, cotangent):
  del graphdef, par
  # No cotangent for the batch (integers) or the loss scale (a constant of the step).
  return jax.tree.map(lambda g: cotangent * g, grads), None, None


_manual_loss.defvjp(_manual_fwd, _manual_bwd)


def _manual_call(graphdef, params, batch, scale, par: Parallelism, with_grad: bool):
  M, pp, v, cp = par.microbatches, par.pp, par.virtual_stages, par.cp
  B, T = batch["inputs"].shape
  context.check_seq_len(T, cp)
  if B % M:
    raise ValueError(f"batch of {B} sequences does not split into {M} micro-batches;"
                     " choose a batch that the number of micro-batches divides")
  manual = tuple(a for a, n in ((pipeline.AXIS, pp), (context.AXIS, cp)) if n > 1)

  def microbatched(x_BxT):  # micro-batch i = rows i, i + M, ...: keeps the batch sharding
    return context.balance(x_BxT, cp).reshape(B // M, M, T).swapaxes(0, 1)

  def local_loss(params, inputs_MxbxT, targets_MxbxT, scale):
    model = nnx.merge(graphdef, params)
    rope = rotary_tables(model.cfg, context.positions(T, cp))
    block_graphdef = nnx.graphdef(model.blocks)

    def stage(layers, x):
      return apply_layers(block_graphdef, layers, x, rope, par, model.cfg)

    if pp > 1:
      outputs = pipeline.circular(stage, params["blocks"], lambda i: model.embed_tokens(inputs_MxbxT[i], par),
                                  M, pp, v, unroll=model.cfg.unroll)
      x_mxbxTxD = pipeline.scatter_from_last(outputs, pp)
      m = M // pp
      targets_mxbxT = jax.lax.dynamic_slice_in_dim(targets_MxbxT, jax.lax.axis_index(pipeline.AXIS) * m, m)
      x_BxTxD = x_mxbxTxD.reshape(-1, *x_mxbxTxD.shape[2:])
      targets_BxT = targets_mxbxT.reshape(-1, targets_mxbxT.shape[-1])
    else:
      inputs_BxT, targets_BxT = (t.reshape(-1, t.shape[-1]) for t in (inputs_MxbxT, targets_MxbxT))
      x_BxTxD = stage(to_layers(params["blocks"], 1), model.embed_tokens(inputs_BxT, par))
    losses = model.token_losses(x_BxTxD, targets_BxT, par)
    return _scaled(jax.lax.psum(jnp.sum(losses), manual) / (B * T), scale)

  specs = jax.tree.map(lambda _: P(), params)
  if pp > 1:
    specs["blocks"] = jax.tree.map(lambda _: P(pipeline.AXIS), params["blocks"])
  tokens = P(None, None, context.AXIS) if cp > 1 else P()
  return jax.shard_map(
      jax.value_and_grad(local_loss) if with_grad else local_loss,
      mesh=jax.sharding.get_abstract_mesh(),
      in_specs=(specs, tokens, tokens, P()),
      out_specs=(P(), specs) if with_grad else P(),
      axis_names=set(manual),
  )(params, microbatched(batch["inputs"]), microbatched(batch["targets"]), scale)
