"""A mixture-of-experts MLP: a top-k softmax router, dropless or capacity routing, and
expert parallelism over the mesh axis ``ep`` by all-to-all.

    y_BxTxD, stats = MoE(cfg, rngs=rngs)(x_BxTxD, par)

Parameters (in a GPT block they sit under ``blocks/mlp`` behind the ``[S, Ls]`` stack axes,
under ``blocks/moe/mlp`` with dense layers between, ``moe_every`` > 1), F = ``d_expert``::

    router/kernel          [D, E]       D over fs and ep; replicated over tp
    experts/{gate,up}      [E, D, F]    E over ep, column-parallel: D over fs, F over tp
    experts/down           [E, F, D]    E over ep, row-parallel: F over tp, D over fs
    shared/{gate,up,down}  a dense MLP's of width F, with ``moe_shared_expert``

Each expert is its own matrix to Dion and the family (the expert axis is a batch axis).

The math, for a token x (router in float32)::

    p = softmax(x W_r)                      [E]
    e_1..e_k = top-k(p),  g_i = p_{e_i} / Σ_j p_{e_j}    (p_{e_i} without renormalization)
    y = Σ_i g_i · expert_{e_i}(x)  (+ shared(x))

Groups are sequences (GShard's groups): with a capacity factor c each expert takes at most
``C = ceil(c·T·k/E)`` of a sequence's T·k assignments, in order of position (then of
choice), so whether a token is dropped never depends on later tokens. A sequence's
load-balancing loss is ``E·Σ_e f_e·P_e`` (Switch), f_e the share of its assignments routed
to e (before drops), P_e its mean router probability; the z-loss is ``logsumexp(x W_r)²``
per token (ST-MoE). Every statistic is a sum over sequences, and routing looks at one
sequence at a time, so any split of the batch over devices and micro-batches computes
exactly one device's result.

Dispatch (dropless by default): each device sorts its tokens' assignments by expert and
multiplies them with grouped matmuls (``jax.lax.ragged_dot``), the rows of expert e in one
contiguous block. With ``ep`` > 1 the sorted rows are cut into one block per ep rank (the
rank holding their experts), exchanged by one ``all_to_all``, sorted again by the
receiver's local experts, multiplied, and sent back by a second ``all_to_all``. Shapes are
static, so a block has room for the worst case: all of the device's assignments
(dropless), or what the capacity allows its experts (``E/ep · sequences · C``). XLA's
ragged all-to-all, which would send only the rows, has no CPU implementation.

How ep composes: ep ranks are data-parallel ranks (the batch is split over rp·fs·ep), each
holding E/ep experts; every other parameter is fully sharded over cp·fs·ep (ZeRO-3 over all
of them: ``models.sharding.DENSE_SHARDS``). Inside the dispatch the experts' D axis is
gathered over fs (and the router's over fs and ep; reduce-scattered back in the backward
pass) and F stays split over tp (Megatron's expert TP): every tp rank routes the same
tokens, exchanges the same rows, multiplies them with its F/tp slice of each expert and
sends back partial sums, which meet the gates and are reduced over tp once per token, as
the dense MLP's; in the backward pass the tokens' gradient is reduced likewise, and the
gates' (``B·T·k`` floats). Sequence parallelism gathers the sequence before the MLP as
before. Pipeline stages stack
experts like every other weight. With context parallelism a rank routes its T/cp tokens of
every sequence; the per-sequence sums behind the balance loss (and the z-loss, the load)
are summed over cp first, so every cp layout reproduces one device. Router and experts are
stored sharded over cp, as over fs, and gathered over cp before the dispatch. A capacity
limit counts places in each expert's queue across the whole sequence: a rank adds to its
own running counts those of the sequence's earlier chunks, all-gathered over cp (one
``[cp, 2, B, E]`` integer gather per layer), so it drops what one device would.

The dispatch runs in a ``shard_map`` manual over the data-parallel axes and tp (left to
XLA's partitioner, tp gathered each layer's experts whole for the grouped matmuls),
under a ``custom_vjp`` whose backward pass re-runs the dispatch under ``jax.vjp`` in a
second ``shard_map``: on jax 0.10 a ``shard_map`` differentiated inside another one (the
per-replica gradient's) fails to lower. The cost is one more forward
pass of the experts, as with ``remat``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from dion_jax import parallel
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from models import fp8
from models.config import GPTConfig
from models.layers import MLP, Dense, init_std
from models.sharding import (BATCH_AXES, EXPERT_LAYOUTS, HISTORY_LAYOUT, KERNEL_LAYOUTS, Parallelism,
                             gathered_over_manual, layout_of)

EXPERT_AXIS = "ep"
CONTEXT_AXIS = "cp"
TENSOR_AXIS = "tp"


class RouterStats(NamedTuple):
  """A layer's routing, summed over the sequences of a batch (float32 scalars unless noted)."""
  balance: jax.Array  # Σ over sequences of the load-balancing loss
  z: jax.Array  # Σ over tokens of logsumexp(router logits)²
  load: jax.Array  # [E] assignments routed to each expert (before drops)
  dropped: jax.Array  # assignments over capacity


class Experts(nnx.Module):
  """E stacked expert MLPs: kernels ``[E, fan_in, fan_out]``, each initialized like a Dense."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_expert

    def kernel(fan_in, fan_out):
      return nnx.Param(init_std(fan_in, fan_out) * jax.random.normal(rngs.params(), (E, fan_in, fan_out)))

    if cfg.mlp == "swiglu":
      self.gate = kernel(D, F)
    self.up = kernel(D, F)
    self.down = kernel(F, D)
    if cfg.fp8 == "delayed":  # each expert's amax histories of its products, in kernels(cfg)'s order
      self.fp8_history = fp8.History(jnp.zeros((E, len(kernels(cfg)), 3, fp8.HISTORY), jnp.float32))


def kernels(cfg: GPTConfig) -> tuple[str, ...]:
  """The names of the experts' kernels, in order."""
  return ("gate", "up", "down") if cfg.mlp == "swiglu" else ("up", "down")


class MoE(nnx.Module):
  """Router, experts and an optional shared expert (module docstring)."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.router = Dense(cfg.d_model, cfg.num_experts, "router", rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.moe_shared_expert:
      self.shared = MLP(cfg, cfg.d_expert, rngs=rngs)
    self.cfg = cfg

  def __call__(self, x_BxTxD: jax.Array, par: Parallelism) -> tuple[jax.Array, RouterStats]:
    weights = {"router": self.router.kernel[...]}
    weights.update({name: getattr(self.experts, name)[...] for name in kernels(self.cfg)})
    if self.cfg.fp8 == "delayed":
      weights[fp8.HISTORY_NAME] = self.experts.fp8_history[...]
    y_BxTxD, stats = _dispatch(x_BxTxD, weights, self.cfg, par)
    if self.cfg.moe_shared_expert:
      y_BxTxD = y_BxTxD + self.shared(x_BxTxD, par)
    return y_BxTxD, stats


def capacity(cfg: GPTConfig, seq_len: int) -> int | None:
  """Assignments each expert takes per sequence (None: dropless)."""
  if cfg.moe_capacity_factor is None:
    return None
  return math.ceil(cfg.moe_capacity_factor * seq_len * cfg.moe_top_k / cfg.num_experts)


def route(x_BxTxD: jax.Array, router_DxE: jax.Array, cfg: GPTConfig
          ) -> tuple[jax.Array, jax.Array, RouterStats]:
  """Each assignment's expert and gate, ``[B·T·k]`` in (sequence, position, choice) order;
  an assignment over capacity gets expert E (none) and gate 0."""
  B, T, _ = x_BxTxD.shape
  E, k = cfg.num_experts, cfg.moe_top_k
  logits_BxTxE = x_BxTxD.astype(jnp.float32) @ router_DxE.astype(jnp.float32)
  probs_BxTxE = jax.nn.softmax(logits_BxTxE, -1)
  top_p_BxTxK, top_e_BxTxK = jax.lax.top_k(probs_BxTxE, k)
  gates_BxTxK = top_p_BxTxK / top_p_BxTxK.sum(-1, keepdims=True) if cfg.moe_renormalize else top_p_BxTxK
  onehot_BxAxE = jax.nn.one_hot(top_e_BxTxK.reshape(B, T * k), E, dtype=jnp.int32)
  # Per-sequence sums: over this rank's T/cp tokens, then over cp (a no-op without cp).
  routed_BxE = _over_cp(onehot_BxAxE.sum(1))
  probs_BxE = _over_cp(probs_BxTxE.sum(1))
  T_seq = T * _cp()
  balance_B = E * jnp.sum(routed_BxE.astype(jnp.float32) / (T_seq * k) * probs_BxE / T_seq, -1)
  z_B = _over_cp(jnp.sum(jnp.square(jax.nn.logsumexp(logits_BxTxE, -1)), -1))
  experts_A, gates_A = top_e_BxTxK.reshape(-1), gates_BxTxK.reshape(-1)
  C = capacity(cfg, T_seq)
  if C is None:
    dropped = jnp.zeros((), jnp.float32)
  else:
    kept_A = (_queue_places(onehot_BxAxE) < C).reshape(-1)
    experts_A, gates_A = jnp.where(kept_A, experts_A, E), jnp.where(kept_A, gates_A, 0.0)
    dropped = _over_cp(jnp.sum(~kept_A).astype(jnp.float32))
  stats = RouterStats(jnp.sum(balance_B), jnp.sum(z_B), routed_BxE.sum(0).astype(jnp.float32), dropped)
  return experts_A, gates_A, stats


def _queue_places(onehot_BxAxE: jax.Array) -> jax.Array:
  """Each assignment's place (from 0) in its expert's queue of the whole sequence, in order
  of position, then of choice: int [B, A].

  With cp this rank holds two of the sequence's 2·cp chunks (``models.context``): its
  places count, besides its own earlier assignments, the earlier chunks' assignments to
  the same expert, which come from every rank's per-chunk counts.
  """
  cp = _cp()
  if cp == 1:
    return jnp.sum(jnp.cumsum(onehot_BxAxE, 1) * onehot_BxAxE, -1) - 1
  B, A, E = onehot_BxAxE.shape
  own_Bx2xHxE = onehot_BxAxE.reshape(B, 2, A // 2, E)
  counts_Rx2xBxE = jax.lax.all_gather(own_Bx2xHxE.sum(2).transpose(1, 0, 2), CONTEXT_AXIS)
  # Chunk c of the sequence is rank c's first for c < cp, rank 2·cp − 1 − c's second after.
  chunks_CxBxE = jnp.concatenate([counts_Rx2xBxE[:, 0], counts_Rx2xBxE[::-1, 1]])
  before_CxBxE = jnp.cumsum(chunks_CxBxE, 0) - chunks_CxBxE
  r = jax.lax.axis_index(CONTEXT_AXIS)
  offset_Bx2xE = jnp.stack([before_CxBxE[r], before_CxBxE[2 * cp - 1 - r]], 1)
  places_Bx2xHxE = jnp.cumsum(own_Bx2xHxE, 2) + offset_Bx2xE[:, :, None]
  return jnp.sum(places_Bx2xHxE * own_Bx2xHxE, -1).reshape(B, A) - 1


def _cp() -> int:
  """cp when inside a ``shard_map`` manual over it (``models.context``), else 1."""
  mesh = jax.sharding.get_abstract_mesh()
  return dict(mesh.shape)[CONTEXT_AXIS] if CONTEXT_AXIS in mesh.manual_axes else 1


def _tp_manual() -> bool:
  """Whether the experts run tp-sharded by hand: inside a ``shard_map`` manual over tp."""
  return TENSOR_AXIS in jax.sharding.get_abstract_mesh().manual_axes


def _over_cp(x: jax.Array) -> jax.Array:
  """``x`` summed over cp, whose ranks hold the other parts of the same sequences."""
  return jax.lax.psum(x, CONTEXT_AXIS) if _cp() > 1 else x


def _expert_mlp(rows_RxD: jax.Array, weights: dict[str, jax.Array], group_sizes_G: jax.Array,
                cfg: GPTConfig) -> jax.Array:
  """The experts' MLPs on rows grouped by expert (group g: the next ``group_sizes[g]`` rows;
  rows past the groups give zeros); their products in FP8 with ``cfg.fp8``
  (``models.fp8.grouped_matmul``: the float32 kernels quantized as they are; with
  "delayed", ``models.fp8.delayed_grouped_matmul`` with each kernel's histories, the
  ``fp8_history`` weight [G, kernels, 3, H])."""
  def dot(x, name):
    if cfg.fp8 == "delayed":
      history_Gx3xH = weights[fp8.HISTORY_NAME][:, kernels(cfg).index(name)]
      y = fp8.delayed_grouped_matmul(x, weights[name], group_sizes_G, history_Gx3xH)
    elif cfg.fp8 != "none":
      y = fp8.grouped_matmul(x, weights[name], group_sizes_G)
    else:
      y = jax.lax.ragged_dot(x, weights[name].astype(x.dtype), group_sizes_G)
    return checkpoint_name(y, f"expert_{name}")

  h_RxF = dot(rows_RxD, "up")
  if cfg.mlp == "swiglu":
    h_RxF = jax.nn.silu(dot(rows_RxD, "gate")) * h_RxF
  else:
    h_RxF = jnp.square(jax.nn.relu(h_RxF))
  return dot(h_RxF, "down")


def _exchange(sorted_AxD: jax.Array, sorted_experts_A: jax.Array, counts_E: jax.Array,
              weights: dict[str, jax.Array], cfg: GPTConfig, slots: int, ep: int) -> jax.Array:
  """The experts' outputs for rows sorted by expert, computed by the ep ranks holding them
  (two all-to-alls of ``[ep, slots, D]``)."""
  A, D = sorted_AxD.shape
  E_loc = cfg.num_experts // ep
  counts_RxEl = counts_E.reshape(ep, E_loc)
  to_rank_R = counts_RxEl.sum(1)
  start_R = jnp.cumsum(to_rank_R) - to_rank_R
  i_S = jnp.arange(slots)
  valid_RxS = i_S < to_rank_R[:, None]
  send_RxSxD = jnp.where(valid_RxS[..., None], sorted_AxD[jnp.clip(start_R[:, None] + i_S, 0, A - 1)], 0)
  recv_RxSxD = jax.lax.all_to_all(send_RxSxD, EXPERT_AXIS, 0, 0, tiled=True)
  recv_counts_RxEl = jax.lax.all_to_all(counts_RxEl, EXPERT_AXIS, 0, 0, tiled=True)
  # The local expert of each received row (E_loc past a source's rows), and a sort by it.
  ends_RxEl = jnp.cumsum(recv_counts_RxEl, 1)
  local_expert = jnp.sum(i_S[None, :, None] >= ends_RxEl[:, None, :], -1).reshape(-1)
  order = jnp.argsort(local_expert, stable=True)
  out = _expert_mlp(recv_RxSxD.reshape(-1, D)[order], weights, recv_counts_RxEl.sum(0), cfg)
  back_RxSxD = jax.lax.all_to_all(out[jnp.argsort(order)].reshape(ep, slots, D), EXPERT_AXIS, 0, 0, tiled=True)
  rank_A = jnp.minimum(sorted_experts_A // E_loc, ep - 1)
  mine_A = jnp.arange(A) - start_R[rank_A]
  return jnp.where((sorted_experts_A < cfg.num_experts)[:, None],
                   back_RxSxD[rank_A, jnp.clip(mine_A, 0, slots - 1)], 0)


def _local(x_BxTxD: jax.Array, weights: dict[str, jax.Array], cfg: GPTConfig, ep: int
           ) -> tuple[jax.Array, RouterStats]:
  """The MoE on one device's sequences, its experts ``weights`` (``E/ep`` of them)."""
  B, T, D = x_BxTxD.shape
  k = cfg.moe_top_k
  experts_A, gates_A, stats = route(x_BxTxD, weights["router"], cfg)
  order = jnp.argsort(experts_A, stable=True)
  sorted_experts_A = experts_A[order]
  counts_E = jnp.sum(jax.nn.one_hot(experts_A, cfg.num_experts, dtype=jnp.int32), 0)
  if _tp_manual():
    # Each tp rank's experts give partial sums of the rows: marking the tokens varying here
    # puts the transposed reduction on the tokens' gradient, [B·T, D], not on the rows.
    x_BxTxD = jax.lax.pcast(x_BxTxD, TENSOR_AXIS, to="varying")
  sorted_AxD = x_BxTxD.reshape(B * T, D)[order // k]
  if ep == 1:
    out_AxD = _expert_mlp(sorted_AxD, weights, counts_E, cfg)
  else:
    C = capacity(cfg, T * _cp())
    slots = B * T * k if C is None else min(B * T * k, cfg.num_experts // ep * B * C)
    out_AxD = _exchange(sorted_AxD, sorted_experts_A, counts_E, weights, cfg, slots, ep)
  out_NxKxD = out_AxD[jnp.argsort(order)].reshape(B * T, k, D).astype(jnp.float32)
  y_NxD = jnp.einsum("nk,nkd->nd", gates_A.reshape(B * T, k), out_NxKxD)
  y_BxTxD = y_NxD.reshape(B, T, D).astype(x_BxTxD.dtype)
  # The row-parallel down product's partial sums, reduced once per token as in the dense MLP.
  return (jax.lax.psum(y_BxTxD, TENSOR_AXIS) if _tp_manual() else y_BxTxD), stats


def _stored_layout(name: str) -> P:
  if name == fp8.HISTORY_NAME:
    return HISTORY_LAYOUT
  return KERNEL_LAYOUTS["router"][0] if name == "router" else EXPERT_LAYOUTS[layout_of([name])]


def _split_layout(name: str, axes: set[str]) -> tuple[P, int | None]:
  """A dispatch weight's stored layout (``models.sharding``) over ``axes``, those the dispatch
  is manual over (data-parallel and tp): its ``in_specs``; and the dimension sharded over fs,
  gathered inside (the router's D over fs·ep, the experts' over fs: ep keeps whole experts,
  tp its slice of each; None for the experts' amax histories, split over ep only)."""
  spec = P(*(tuple(a for a in parallel.axis_names(e) if a in axes) or None for e in _stored_layout(name)))
  return spec, next((i for i, e in enumerate(spec) if "fs" in parallel.axis_names(e)), None)


def _dispatch(x_BxTxD: jax.Array, weights: dict[str, jax.Array], cfg: GPTConfig, par: Parallelism
              ) -> tuple[jax.Array, RouterStats]:
  if par.mesh is None:
    return _local(x_BxTxD, weights, cfg, 1)
  ep = par.size(EXPERT_AXIS)
  # Taken once, for the backward pass too, which is traced outside this context.
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(mesh.manual_axes)
  region = tuple(a for a in BATCH_AXES if a not in manual)
  data = P(region)
  # tp too: each rank multiplies its slice of every expert (Megatron's expert TP).
  axes = set(region) | ({TENSOR_AXIS} - manual)
  layouts = {name: _split_layout(name, axes) for name in weights}
  # Inside the shard_map manual over cp, the weights entered as their cp blocks.
  weights = {name: gathered_over_manual(w, _stored_layout(name)) for name, w in weights.items()}
  w_specs = {name: spec for name, (spec, _) in layouts.items()}

  def body(x, weights):
    full = {}
    for name, w in weights.items():
      spec, dim = layouts[name]
      full[name] = w if dim is None else jax.lax.all_gather(w, spec[dim], axis=dim, tiled=True)
    y, stats = _local(x, full, cfg, ep)
    return y, jax.tree.map(lambda s: jax.lax.psum(s, region), stats)

  def shard_map(f, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes)

  stat_specs = RouterStats(P(), P(), P(), P())

  @jax.custom_vjp
  def apply(x, weights):
    return shard_map(body, (data, w_specs), (data, stat_specs))(x, weights)

  def forward(x, weights):
    return apply(x, weights), (x, weights)

  def backward(residuals, cotangents):
    def vjp(x, weights, cotangents):
      return jax.vjp(body, x, weights)[1](cotangents)

    return shard_map(vjp, (data, w_specs, (data, stat_specs)), (data, w_specs))(*residuals, cotangents)

  apply.defvjp(forward, backward)
  return apply(x_BxTxD, weights)


def router_loss(stats: RouterStats, cfg: GPTConfig, sequences: jax.Array, seq_len: int) -> jax.Array:
  """The auxiliary losses of ``stats`` (any leading layer axes, summed) as a mean over
  ``sequences``: ``(aux_coeff·Σ balance + z_coeff·Σ z / T) / sequences``."""
  return (cfg.moe_aux_loss_coeff * jnp.sum(stats.balance)
          + cfg.moe_z_loss_coeff * jnp.sum(stats.z) / seq_len) / sequences
