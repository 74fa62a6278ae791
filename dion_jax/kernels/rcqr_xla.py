"""The XLA composition of randomized Cholesky QR's three passes over P (the fallback
of the Pallas kernels in ``dion_jax.kernels.rcqr``, computing the same products).

Every product runs at ``Precision.HIGHEST``: float32, where XLA would otherwise use
TF32 on recent GPUs (10 mantissa bits, far from the orthonormality these passes
restore)."""
import jax
import jax.numpy as jnp
from jax import lax

from dion_jax.kernels import sketch
from dion_jax.kernels.lapack import upper_inverse

_F32 = lax.Precision.HIGHEST


def xla_sketch_product(P_mxr: jax.Array, seed: jax.Array, k: int, row_start: jax.Array) -> jax.Array:
  """``S[:, row_start:row_start+m] @ P`` with S from ``dion_jax.kernels.sketch``; (k, r) float32."""
  S_kxm = sketch.sketch_block(seed, row_start, P_mxr.shape[0], k)
  return jnp.matmul(S_kxm, P_mxr.astype(jnp.float32), precision=_F32, preferred_element_type=jnp.float32)


def xla_solve(P_mxr: jax.Array, R_rxr: jax.Array) -> jax.Array:
  """``P R⁻¹`` in float32, as a matmul with the explicit inverse of the small R.

  A CPU trsm of a tall P runs at a fraction of matmul speed, and the Pallas kernels
  do the same. The price is
  accuracy in P's weakest directions when R is ill conditioned: on a P whose two
  columns agree to 1e-5, P's span is kept to ~1e-3 instead of ~1e-5 (a rotation
  within directions Dion's update weighs by their tiny singular values anyway).
  """
  return jnp.matmul(P_mxr.astype(jnp.float32), upper_inverse(R_rxr), precision=_F32,
                    preferred_element_type=jnp.float32)


def xla_solve_and_gram(P_mxr: jax.Array, R_rxr: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``P₁ = P R⁻¹`` (float32) and its local Gram matrix ``P₁ᵀ P₁``."""
  P1_mxr = xla_solve(P_mxr, R_rxr)
  return P1_mxr, jnp.matmul(P1_mxr.T, P1_mxr, precision=_F32)
