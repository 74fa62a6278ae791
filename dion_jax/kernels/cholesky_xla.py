"""The XLA composition of the Cholesky leaf (the fallback of the Pallas kernel in
``dion_jax.kernels.cholesky``, the same arithmetic): for a batch of symmetric positive
definite A (B, n, n), the lower-triangular L with A = L Lᵀ and its inverse X = L⁻¹.

One loop over the n columns, each step on the whole batch at once::

    s  = √A[j, j]
    l  = A[:, j] / s  on rows ≥ j, 0 above          column j of L
    A ← A − l lᵀ,  A[:, j] = l                      right-looking Cholesky, L in A's place
    x  = X[j, :] / s                                column-oriented forward
    X ← X − l₊ xᵀ,  X[j, :] = x                     substitution (l₊: l below row j)

so X is built from L's columns as they appear, with no second loop and no triangular
solve, and column j of A, which the update has just eliminated, keeps column j of L. A
pivot that is not positive gives NaN, as LAPACK's and cuSOLVER's Cholesky do.
The loop is a ``fori_loop``: on a CPU it costs n small batched steps, and no LAPACK call
(whose batched form can deadlock XLA's thread pool, ``dion_jax.kernels.lapack``). On a GPU
each step would be a kernel launch: there the Pallas kernel runs all n steps in one.
"""
import jax
import jax.numpy as jnp
from jax import lax


def elimination_step(j, A_nxn, X_nxn, column, row):
  """Step j of the loop above on one matrix's (A, X); ``column(M, j)`` and ``row(M, j)``
  read M[:, j] and M[j, :] (the kernel and the fallback read them differently, exactly)."""
  n = A_nxn.shape[-1]
  idx_n = lax.broadcasted_iota(jnp.int32, (n,), 0)
  col_n = column(A_nxn, j)
  s = jnp.sqrt(jnp.sum(jnp.where(idx_n == j, col_n, 0.0)))
  l_n = jnp.where(idx_n >= j, col_n / s, 0.0)
  A_nxn = jnp.where((idx_n == j)[None, :], l_n[:, None], A_nxn - l_n[:, None] * l_n[None, :])
  x_n = row(X_nxn, j) / s
  below_n = jnp.where(idx_n > j, l_n, 0.0)
  X_nxn = jnp.where((idx_n == j)[:, None], x_n[None, :], X_nxn - below_n[:, None] * x_n[None, :])
  return A_nxn, X_nxn


def xla_cholesky_and_inverse(A_bxnxn: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(L, X)``: L = chol(A) and X = L⁻¹ (both lower triangular) of every matrix of a batch
  (B, n, n); float32."""
  A_bxnxn = A_bxnxn.astype(jnp.float32)
  n = A_bxnxn.shape[-1]
  column = lambda M, j: lax.dynamic_index_in_dim(M, j, axis=1, keepdims=False)
  row = lambda M, j: lax.dynamic_index_in_dim(M, j, axis=0, keepdims=False)
  step = jax.vmap(lambda j, A, X: elimination_step(j, A, X, column, row), in_axes=(None, 0, 0))
  X0 = jnp.zeros_like(A_bxnxn) + jnp.eye(n, dtype=jnp.float32)  # varies over A's mesh axes, as the loop's carry must
  return lax.fori_loop(0, n, lambda j, carry: step(j, *carry), (A_bxnxn, X0))
