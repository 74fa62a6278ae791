"""float32 matmuls on TF32 tensor cores: XLA's dot algorithms on a GPU, emulated elsewhere.

TF32 is float32 with 10 of its 23 explicit mantissa bits (11 significant bits). NVIDIA's
tensor cores (Ampere on) multiply TF32 and accumulate in float32, on an H100 at about
495 TFLOP/s dense against 67 for float32 on the CUDA cores. Two ways to use them:

- one TF32 product (XLA's ``TF32_TF32_F32``, its default for float32 on such GPUs): each
  operand rounded to 11 bits, a relative error near 2⁻¹¹;
- three (``TF32_TF32_F32_X3``): each operand split as ``x = hi + lo`` with ``hi`` its TF32
  rounding and ``lo`` the TF32 rounding of the remainder (22 significant bits together),
  and ``A B ≈ hi_A lo_B + lo_A hi_B + hi_A hi_B`` (the dropped ``lo_A lo_B`` is below
  2⁻²² of the product): float32's accuracy at a third of the tensor cores' rate, still
  about 2.5x the CUDA cores'.

XLA's CPU backend has no TF32 algorithm (it rejects them), so there the same arithmetic is
emulated: operands rounded to TF32 in float32 (a product of two TF32 numbers is exact in
float32) and float32 matmuls, which accumulate as the tensor cores do up to the order of
the sums. Which one runs is decided when traced, by ``jax.default_backend()``.
"""
import jax
import jax.numpy as jnp
from jax import lax

from dion_jax import validation

PRECISIONS = ("float32", "tensorfloat32x3")


def round_to_tf32(x: jax.Array) -> jax.Array:
  """float32 rounded to TF32's 10 mantissa bits (to nearest, ties to even), still float32:
  a product of two such numbers is exact in float32, so a float32 matmul of them
  accumulates what a TF32 tensor core would."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
  return lax.bitcast_convert_type(bits, jnp.float32)


def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(hi, lo)``: x's TF32 rounding and the TF32 rounding of what it leaves, float32."""
  hi = round_to_tf32(x)
  return hi, round_to_tf32(x.astype(jnp.float32) - hi)


def einsum(spec: str, a: jax.Array, b: jax.Array, precision: str = "float32") -> jax.Array:
  """``jnp.einsum(spec, a, b)`` of two operands in float32, accumulated in float32.

  ``precision``: ``"float32"`` (``Precision.HIGHEST``: IEEE float32 products, the CUDA
  cores on a GPU) or ``"tensorfloat32x3"`` (three TF32 products, module docstring).
  """
  validation.check_choice("precision", precision, PRECISIONS)
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  mm = lambda x, y, p: jnp.einsum(spec, x, y, precision=p, preferred_element_type=jnp.float32)
  if precision == "float32":
    return mm(a, b, lax.Precision.HIGHEST)
  if jax.default_backend() == "gpu":
    return mm(a, b, lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
  (a_hi, a_lo), (b_hi, b_lo) = split(a), split(b)
  small = mm(a_hi, b_lo, lax.Precision.HIGHEST) + mm(a_lo, b_hi, lax.Precision.HIGHEST)
  return small + mm(a_hi, b_hi, lax.Precision.HIGHEST)
