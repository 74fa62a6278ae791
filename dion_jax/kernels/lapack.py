"""Small dense factorizations (QR, Cholesky, triangular inverse) from the vendor libraries.

LAPACK on CPU and cuSOLVER/cuBLAS on GPU. The orthonormalizations call them on small
matrices (r x r, k x r) of a whole batch; how a batch reaches the library matters on
both backends (:func:`one_matrix_at_a_time`).
"""
import jax
import jax.numpy as jnp
from jax import lax


def one_matrix_at_a_time(*backends: str):
  """Decorates ``f`` (a factorization of one matrix) so that, vmapped on one of
  ``backends``, it loops over the batch (``lax.map``) instead of calling the batched
  kernel; elsewhere it stays batched.

  - ``"cpu"``: jaxlib's batched LAPACK kernels split the batch over XLA's intra-op
    thread pool and wait for it from a pool thread. When every pool thread does that
    at once (several devices, or several independent factorizations in one program),
    none is left to run the work and the program hangs (seen on jax 0.10.2 with 8 CPU
    devices and a batch of 8 sketch QRs).
  - ``"gpu"``, for QR: a batched ``jnp.linalg.qr`` runs cuSOLVER's unblocked batched
    Householder kernel (``geqr2_batch_kernel``), meant for tiny matrices and far slower
    than one matrix at a time at Dion's sizes (measured on an H100:
    ``benchmarks/results/gpu/``).

  These factorizations are small (r x r, k x r); the heavy passes over P stay batched.
  """

  def decorate(f):
    @jax.custom_batching.custom_vmap
    def g(*args):
      return f(*args)

    @g.def_vmap
    def _(axis_size, in_batched, *args):
      if axis_size == 1:  # No loop for one matrix.
        out = g(*(a[0] if batched else a for a, batched in zip(args, in_batched)))
        return jax.tree.map(lambda x: x[None], out), jax.tree.map(lambda _: True, out)
      args = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, batched in zip(args, in_batched)]
      if jax.default_backend() in backends:  # Decided when traced, not at import.
        out = lax.map(lambda xs: g(*xs), tuple(args))
      else:
        out = jax.vmap(f)(*args)
      return out, jax.tree.map(lambda _: True, out)

    return g

  return decorate


@one_matrix_at_a_time("cpu")
def upper_inverse(R_rxr: jax.Array) -> jax.Array:
  """R⁻¹ of an upper-triangular R (r x r)."""
  eye = jnp.eye(R_rxr.shape[-1], dtype=R_rxr.dtype)
  return lax.linalg.triangular_solve(R_rxr, eye, left_side=True, lower=False)


@one_matrix_at_a_time("cpu")
def cholesky_upper(G_rxr: jax.Array) -> jax.Array:
  return jnp.linalg.cholesky(G_rxr).T


@one_matrix_at_a_time("cpu", "gpu")
def qr_r(A_kxr: jax.Array) -> jax.Array:
  return jnp.linalg.qr(A_kxr, mode="r")


@one_matrix_at_a_time("cpu", "gpu")
def qr_q(A_mxr: jax.Array) -> jax.Array:
  return jnp.linalg.qr(A_mxr)[0]
