"""The XLA composition of the polar iterations' symmetric products (the fallback of
the Pallas kernels in ``dion_jax.kernels.newton_schulz``)."""
import jax
import jax.numpy as jnp


def xla_symmetric_products(X_bxsxl: jax.Array, b: float, c: float, precision=None, gram=None) -> jax.Array:
  """``B = b·A + c·A²`` with ``A = X Xᵀ``; (B, s, s) in X's dtype. ``gram`` (X -> A), when
  given, forms A instead of a local matmul (X's columns sharded: a sum over devices)."""
  A = jnp.einsum("bsl,btl->bst", X_bxsxl, X_bxsxl, precision=precision) if gram is None else gram(X_bxsxl)
  return b * A + c * jnp.einsum("bst,btu->bsu", A, A, precision=precision)
