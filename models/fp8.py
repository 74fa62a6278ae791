"""FP8 matrix products with current per-tensor scaling (Transformer Engine's
``Float8CurrentScaling``), from ``flax.linen.fp8_ops``' pieces.

    y = fp8.matmul(x_BxTxK, w_KxN)         # x in the compute dtype, w float32: y in x's dtype

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
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

RECIPES = ("none", "current")
FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2
# Manual mesh axes over which a tensor's shards are different tensors, not parts of one.
_OWN_TENSOR_AXES = ("pp",)


def amax(x: jax.Array) -> jax.Array:
  """max |x| over the whole logical tensor, float32 scalar (module docstring)."""
  m = jnp.max(jnp.abs(x)).astype(jnp.float32)
  parts = tuple(a for a in jax.typeof(m).manual_axis_type.varying if a not in _OWN_TENSOR_AXES)
  return jax.lax.pmax(m, parts) if parts else m


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """``(q, s)``: x in the FP8 ``dtype`` scaled so that its amax is the type's largest
  value, and the float32 scale s (x ≈ q·s; 1 for an all-zero x, NaN for a non-finite one)."""
  m = amax(x)
  scale = fp8_ops.compute_scale(m, jnp.ones((), jnp.float32), fp8_ops.get_fp8_max(dtype, jnp.float32))
  # flax keeps the last scale for a non-finite amax, and the cast would clip an inf to the
  # largest FP8 value: NaN instead, so that an overflow (float16's, which loss scaling
  # must see) reaches the loss and the step's guard as it does without FP8.
  scale = jnp.where(jnp.isfinite(m), scale, jnp.nan)
  return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


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
