"""The XLA composition of the polar iterations' symmetric products (the fallback of
the Pallas kernels in ``dion_jax.kernels.newton_schulz``)."""
import jax
import jax.numpy as jnp


def xla_symmetric_products(X_bxsxl: jax.Array, b: float, c: float, precision=None) -> jax.Array:
  """``B = b·A + c·A²`` with ``A = X Xᵀ``; (B, s, s) in X's dtype."""
  A = jnp.einsum("bsl,btl->bst", X_bxsxl, X_bxsxl, precision=precision)
  return b * A + c * jnp.einsum("bst,btu->bsu", A, A, precision=precision)
