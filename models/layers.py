"""The GPT's basic layers: a bias-free Dense kernel, the dense MLP, an RMS norm, the
embedding lookup."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from dion_jax import parallel
from models import fp8 as fp8_lib
from models.config import GPTConfig
from models.sharding import Parallelism, in_auto_axes, without_manual


def init_std(fan_in: int, fan_out: int) -> float:
  """σ = min(1, sqrt(fan_out/fan_in)) / sqrt(fan_in) (arXiv 2310.17813, as the reference)."""
  return min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class Dense(nnx.Module):
  """A bias-free kernel (fan_in, fan_out), column- or row-parallel, its product in FP8
  with ``fp8`` a recipe of ``models.fp8.RECIPES`` other than "none" (``models/fp8.py``: the
  float32 kernel quantized as it is, not through the compute dtype); "delayed" adds its
  amax histories (``models.fp8.History``, ``fp8_history`` beside ``kernel``).

  Initialized N(0, σ²), σ = :func:`init_std`.
  """

  def __init__(self, fan_in: int, fan_out: int, layout: str, *, fp8: str = "none", rngs: nnx.Rngs):
    self.kernel = nnx.Param(init_std(fan_in, fan_out) * jax.random.normal(rngs.params(), (fan_in, fan_out), jnp.float32))
    self.layout = layout
    self.fp8 = fp8
    if fp8 == "delayed":
      self.fp8_history = fp8_lib.History(jnp.zeros((3, fp8_lib.HISTORY), jnp.float32))

  def __call__(self, x: jax.Array, par: Parallelism) -> jax.Array:
    kernel = par.weight(self.kernel[...], self.layout)
    if self.fp8 == "delayed":
      return fp8_lib.delayed_matmul(x, kernel, self.fp8_history[...])
    return fp8_lib.matmul(x, kernel) if self.fp8 == "current" else x @ kernel.astype(x.dtype)


class MLP(nnx.Module):
  """Column-parallel up (and gate), ReLU² (or SwiGLU: silu(gate)·up), row-parallel down;
  ``width`` hidden units (default ``cfg.d_mlp``)."""

  def __init__(self, cfg: GPTConfig, width: int | None = None, *, rngs: nnx.Rngs):
    F = cfg.d_mlp if width is None else width
    fp8 = cfg.fp8
    if cfg.mlp == "swiglu":
      self.gate = Dense(cfg.d_model, F, "column", fp8=fp8, rngs=rngs)
    self.up = Dense(cfg.d_model, F, "column", fp8=fp8, rngs=rngs)
    self.down = Dense(F, cfg.d_model, "row", fp8=fp8, rngs=rngs)
    self.kind = cfg.mlp

  def __call__(self, x_BxTxD: jax.Array, par: Parallelism) -> jax.Array:
    h_BxTxF = checkpoint_name(par.constrain(self.up(x_BxTxD, par), "batch", None, "mlp"), "mlp_up")
    if self.kind == "swiglu":
      g_BxTxF = checkpoint_name(par.constrain(self.gate(x_BxTxD, par), "batch", None, "mlp"), "mlp_gate")
      a_BxTxF = jax.nn.silu(g_BxTxF) * h_BxTxF
    else:
      a_BxTxF = jnp.square(jax.nn.relu(h_BxTxF))
    return checkpoint_name(self.down(a_BxTxF, par), "mlp_down")


def embedding_lookup(table_VxD: jax.Array, tokens_BxT: jax.Array, par: Parallelism) -> jax.Array:
  """``table_VxD[tokens_BxT]``: [B, T, D], the table's rows (vocab-parallel over tp as
  :meth:`Parallelism.weight` leaves it, batch over the data-parallel axes).

  Its gradient, the table's [V, D] = Σ over the batch's tokens of their cotangents, is
  summed in a ``shard_map`` manual over the batch axes: each rank scatter-adds its own
  tokens and the ranks' tables are summed over those axes (reduced to the fs shards by
  :meth:`Parallelism.weight`'s transpose, like every weight's). Left to the partitioner,
  inside a ``shard_map`` manual over other axes (the replicas' gradient, manual over rp)
  XLA all-gathers the cotangents and token ids over fs instead: B·T·D floats per
  micro-batch in place of V/tp·D. The lookup itself is written out over tp (:func:`_rows`),
  which XLA from jaxlib 0.11 fails to partition inside a shard_map manual over cp or pp.
  For a batch that does not split over the batch axes the lookup is left to the partitioner.
  """
  batch_axes = tuple(a for a in parallel.axis_names(*par.spec("batch")) if par.size(a) > 1)
  if not batch_axes or tokens_BxT.shape[0] % math.prod(par.size(a) for a in batch_axes):
    return jnp.take(table_VxD, tokens_BxT, axis=0)
  return _lookup(table_VxD, tokens_BxT, batch_axes)


def _rows(table_VxD: jax.Array, tokens_BxT: jax.Array, batch_axes: tuple[str, ...]) -> jax.Array:
  """``jnp.take(table_VxD, tokens_BxT, axis=0)``, the table vocab-parallel over tp and the
  tokens split over ``batch_axes``, written out: each rank looks up the tokens among its
  own V/tp rows (zeros for the others'), and the ranks' rows are summed over tp, an
  all-reduce of [B, T, D] (exact: one rank holds each row).

  Left to the partitioner inside a ``shard_map`` manual over another axis, XLA from jaxlib
  0.11 (0.11.2 and 0.12.0.1, GSPMD and Shardy) aborts the process in that all-reduce's
  device groups (``Check failed`` in ``spmd_partitioner_util.cc``): the model on
  fs=2,cp=2,tp=2 (manual over cp), the trainer's step on fs=2,tp=2,pp=2 (over pp).
  Written out, on jax 0.10.2 the trainer's step sends what XLA's own partitioning sent,
  collective for collective, but with sequence parallelism, where XLA chose by size:
  ``tiny``'s 384-row table all-gathered over tp in place of the 256 KB all-reduce (64 KB
  less on fs=2,tp=2), at 4096 rows the same all-reduce and token ids and rows moved over
  fs·tp besides (132 KB more). Manual over every axis, the gather is local.
  """
  table_spec = P(*without_manual(P(parallel.TENSOR_PARALLEL_AXIS)), None)
  if table_spec[0] is None or jax.sharding.get_abstract_mesh().shape[table_spec[0]] == 1:
    return jnp.take(table_VxD, tokens_BxT, axis=0)
  tp = table_spec[0]

  def held_rows(table_vxD, tokens_bxT):
    V_local = table_vxD.shape[0]
    # Negative ids count from the end of the whole table, as jnp.take has them.
    ids_bxT = jnp.where(tokens_bxT < 0, tokens_bxT + V_local * jax.lax.axis_size(tp), tokens_bxT)
    local_bxT = ids_bxT - jax.lax.axis_index(tp) * V_local
    held_bxT = (local_bxT >= 0) & (local_bxT < V_local)
    rows_bxTxD = jnp.take(table_vxD, jnp.where(held_bxT, local_bxT, 0), axis=0)
    return jax.lax.psum(jnp.where(held_bxT[..., None], rows_bxTxD, 0), tp)

  return in_auto_axes(held_rows, (table_spec, P(batch_axes)), P(batch_axes))(table_VxD, tokens_BxT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table_VxD, tokens_BxT, batch_axes):
  return _rows(table_VxD, tokens_BxT, batch_axes)


def _lookup_fwd(table_VxD, tokens_BxT, batch_axes):
  # A [V, 0] slice carries the table's shape and dtype to the backward pass, not its values.
  return _rows(table_VxD, tokens_BxT, batch_axes), (tokens_BxT, table_VxD[:, :0])


def _lookup_bwd(batch_axes, residuals, cotangent_BxTxD):
  tokens_BxT, empty_Vx0 = residuals
  V, D = empty_Vx0.shape[0], cotangent_BxTxD.shape[-1]

  def summed(tokens_BxT, cotangent_BxTxD):
    grad_VxD = jnp.zeros((V, D), empty_Vx0.dtype).at[tokens_BxT].add(cotangent_BxTxD.astype(empty_Vx0.dtype))
    return jax.lax.psum(grad_VxD, batch_axes)

  spec = P(batch_axes)
  grad_VxD = jax.shard_map(summed, in_specs=(spec, spec), out_specs=P(), axis_names=set(batch_axes))(
      tokens_BxT, cotangent_BxTxD)
  return grad_VxD, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
