"""FP8 matrix products with current per-tensor scaling (Transformer Engine's
``Float8CurrentScaling``), from ``flax.linen.fp8_ops``' pieces.

    y = fp8.matmul(x_BxTxK, w_KxN)         # x in the compute dtype, w float32: y in x's dtype
    y = fp8.grouped_matmul(x_RxK, w_GxKxN, group_sizes_G)   # the experts' (ragged_dot)

Forward, the input and the weight are each scaled by their own absolute maximum and cast
to e4m3 (``s = amax / 448``, ``q = round_e4m3(clip(v / s, ±448))``); the product of the two
e4m3 tensors accumulates in float32 and is multiplied by ``s_x·s_w``. Backward, the
output's gradient g is cast likewise to e5m2 (``s_g = amax(g) / 57344``), and the two
products of the backward pass take the e4m3 tensors the forward pass kept::

    dx = (q_g q_wᵀ) · s_g·s_w        dw = (q_xᵀ q_g) · s_x·s_g      (float32 accumulation)

So the forward pass keeps the e4m3 input and weight (a byte an element) for the backward
one, and every product of the three is an FP8 ``dot_general`` with a scalar dequantization
after it: the pattern XLA's GPU compiler rewrites into one cuBLASLt FP8 GEMM with its
scales (``__cublas$lt$matmul$f8``); XLA:CPU emulates the FP8 types.

"Current" scaling: each scale comes from this step's tensor itself, so there is no state
to keep, checkpoint or shard (a delayed recipe's amax history would be). The amax is that
of the whole logical tensor on every mesh: XLA reduces it over the axes its partitioner
shards; inside a ``shard_map`` it is maxed over the manual axes the tensor varies over
(the replicas of Dion's per-replica gradients, cp), except the pipeline's ``pp``, whose
stages hold different layers. Every mesh thus quantizes what one device quantizes for the
same micro-batches (a scalar all-reduce per tensor where a manual axis splits it).

The experts' kernels [G, K, N] take one scale per expert (the amax of each kernel, maxed
over the manual axes that split a kernel, tp, but not over ``ep``, whose ranks hold other
experts): the experts drift apart in magnitude as they train, and one scale for all would
flush a small expert's weights below e4m3's subnormals. The rows keep one scale.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

RECIPES = ("none", "current")
FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2
# Manual mesh axes over which a tensor's shards are different tensors, not parts of one;
# with a scale per expert also ep (models.moe.EXPERT_AXIS), whose shards hold other experts.
_OWN_TENSOR_AXES = ("pp",)
_EXPERTS_AXIS = "ep"


def amax(x: jax.Array, per_expert: bool = False) -> jax.Array:
  """max |x| over the whole logical tensor, float32 scalar; ``per_expert``: over each
  expert's slice x[g] of a [G, ...] stack, float32 [G] (module docstring)."""
  m = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)) if per_expert else None).astype(jnp.float32)
  own = _OWN_TENSOR_AXES + ((_EXPERTS_AXIS,) if per_expert else ())
  parts = tuple(a for a in jax.typeof(m).manual_axis_type.varying if a not in own)
  return jax.lax.pmax(m, parts) if parts else m


def quantize(x: jax.Array, dtype, per_expert: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(q, s)``: x in the FP8 ``dtype`` scaled so that its amax is the type's largest
  value, and the float32 scale s (x ≈ q·s; 1 for an all-zero x, NaN for a non-finite one);
  ``per_expert``: each expert's slice x[g] of a [G, ...] stack by its own, s [G]."""
  m = amax(x, per_expert)
  scale = fp8_ops.compute_scale(m, jnp.ones_like(m), fp8_ops.get_fp8_max(dtype, jnp.float32))
  # flax keeps the last scale for a non-finite amax, and the cast would clip an inf to the
  # largest FP8 value: NaN instead, so that an overflow (float16's, which loss scaling
  # must see) reaches the loss and the step's guard as it does without FP8.
  scale = jnp.where(jnp.isfinite(m), scale, jnp.nan)
  return fp8_ops.quantize(x, dtype, scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim)), jnp.float32), scale


def _product(a: jax.Array, b: jax.Array, contract: tuple[Sequence[int], Sequence[int]], scale: jax.Array) -> jax.Array:
  """The FP8 product of ``a`` and ``b`` over the ``contract`` dimensions, accumulated in
  float32 and dequantized by ``scale``."""
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32) * scale


@jax.custom_vjp
def matmul(x: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x @ w_KxN`` (x [..., K]) through FP8 (module docstring), in x's dtype."""
  return _forward(x, w_KxN)[0]


def _forward(x, w_KxN):
  q_x, s_x = quantize(x, FORWARD)
  q_w, s_w = quantize(w_KxN, FORWARD)
  y = _product(q_x, q_w, ((x.ndim - 1,), (0,)), s_x * s_w).astype(x.dtype)
  return y, (q_x, s_x, q_w, s_w, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w_KxN.dtype))


def _backward(residuals, g):
  q_x, s_x, q_w, s_w, x_dtype, w_dtype = residuals
  q_g, s_g = quantize(g, BACKWARD)
  leading = tuple(range(g.ndim - 1))
  dx = _product(q_g, q_w, ((g.ndim - 1,), (1,)), s_g * s_w).astype(x_dtype.dtype)
  dw = _product(q_x, q_g, (leading, leading), s_x * s_g).astype(w_dtype.dtype)
  return dx, dw


matmul.defvjp(_forward, _backward)


# The grouped products' dimensions: rows [R, K] in groups, experts' kernels [G, K, N].
_ROWS_BY_KERNELS = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [0], [0])
_GRADIENT_BY_KERNELS = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
_ROWS_BY_GRADIENT = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])


def _grouped(a, b, group_sizes_G, dims, scale):
  """``jax.lax.ragged_dot_general`` of FP8 ``a`` and ``b``, accumulated in float32 and
  dequantized by ``scale``."""
  return jax.lax.ragged_dot_general(a, b, group_sizes_G, dims, preferred_element_type=jnp.float32) * scale


@jax.custom_vjp
def grouped_matmul(x_RxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """``jax.lax.ragged_dot(x_RxK, w_GxKxN, group_sizes_G)`` (the rows of group g times kernel
  g) through FP8 as :func:`matmul`: one scale for all the rows and one for each expert's
  kernel (Transformer Engine's grouped linear: an expert whose weights are small keeps its
  precision beside large ones), so row r's product is dequantized by ``s_x·s_w[g(r)]``; in
  x's dtype. Backward ``dx = ragged(q_g, q_wᵀ)·s_g·s_w[g(r)]``,
  ``dw[g] = q_x[rows of g]ᵀ q_g[rows of g]·s_x·s_g``, both from the e4m3 tensors kept forward."""
  return _grouped_forward(x_RxK, w_GxKxN, group_sizes_G)[0]


def _row_scales(s_w_G: jax.Array, group_sizes_G: jax.Array, rows: int) -> jax.Array:
  """Each row's expert's kernel scale, float32 [R, 1] (rows past the groups, whose
  products are zeros, take the last expert's)."""
  expert_R = jnp.repeat(jnp.arange(s_w_G.shape[0]), group_sizes_G, total_repeat_length=rows)
  return s_w_G[expert_R][:, None]


def _grouped_forward(x, w, group_sizes):
  q_x, s_x = quantize(x, FORWARD)
  q_w, s_w = quantize(w, FORWARD, per_expert=True)
  rows_scale = _row_scales(s_w, group_sizes, x.shape[0])
  y = _grouped(q_x, q_w, group_sizes, _ROWS_BY_KERNELS, s_x * rows_scale).astype(x.dtype)
  # Empty slices of x and w: their dtypes and the manual axes they vary over.
  return y, (q_x, s_x, q_w, s_w, group_sizes, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _summed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """``ct`` in ``primal``'s dtype, summed over the manual axes it varies over and the
  primal does not (inside a ``shard_map``: the rows of other ranks' tokens), as autodiff
  sums the gradient of a value shared by those ranks."""
  own = set(jax.typeof(primal).manual_axis_type.varying)
  extra = tuple(a for a in jax.typeof(ct).manual_axis_type.varying if a not in own)
  return (jax.lax.psum(ct, extra) if extra else ct).astype(primal.dtype)


def _grouped_backward(residuals, g):
  q_x, s_x, q_w, s_w, group_sizes, x, w = residuals
  q_g, s_g = quantize(g, BACKWARD)
  dx = _grouped(q_g, q_w, group_sizes, _GRADIENT_BY_KERNELS, s_g * _row_scales(s_w, group_sizes, g.shape[0]))
  dw = _grouped(q_x, q_g, group_sizes, _ROWS_BY_GRADIENT, s_x * s_g)
  return _summed_like(dx, x), _summed_like(dw, w), None


grouped_matmul.defvjp(_grouped_forward, _grouped_backward)
