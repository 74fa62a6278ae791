"""The inverse Cholesky factor of a batch of r x r Gram matrices, in a few launches per batch.

For symmetric positive definite G (B, r, r), :func:`inverse_cholesky` returns W = R⁻¹,
upper triangular, where G = RᵀR (R upper, the factor ``jnp.linalg.cholesky(G).T``), so
that ``P W`` has orthonormal columns when G = PᵀP: the factor and the triangular solve of
Cholesky QR in one. It is computed with L = Rᵀ and X = L⁻¹ by recursion on 2 x 2 blocks::

    G = [A₁₁ A₁₂; A₂₁ A₂₂]    L₁₁, X₁₁ = L₁₁⁻¹                (recursion on A₁₁)
                              L₂₁ = A₂₁ X₁₁ᵀ
                              L₂₁ ← L₂₁ + (A₂₁ − L₂₁ L₁₁ᵀ) X₁₁ᵀ   (one step of refinement)
                              L₂₂, X₂₂ = L₂₂⁻¹                (recursion on S = A₂₂ − L₂₁ L₂₁ᵀ)
                              X₂₁ = −X₂₂ (L₂₁ X₁₁)

down to diagonal blocks of b = min(128, r rounded up to a power of two) columns, each
factored and inverted by one batched kernel (``dion_jax.kernels.cholesky``; G is padded
with an identity block to a multiple of b). Every other op is a batched matmul at
``Precision.HIGHEST`` or a slice. Nothing here launches per matrix: for r = 384 (3
blocks) a call is 3 kernel launches and 12 matmuls for the whole batch, 6 and 30 for
r = 768.

The refinement is what makes the recursion as safe as LAPACK's blocked Cholesky, which
gets L₂₁ from a triangular solve. The first product alone carries X₁₁'s error, up to
cond(L₁₁)·u relative; in shifted Cholesky QR's passes cond(L₁₁) reaches 1/√u, so L₂₁
is off by up to √u ≈ 3e-4 of its size while S's smallest eigenvalues are at the
shift's scale, u·‖G‖. Without it the Schur complement lost its positive definiteness
on Grams from training (Dion's first step on ``small``'s width, a P of condition 3e8:
NaN from the second block on, where LAPACK's factor was finite), and Dion's guard then
zeroed that matrix's Q. With it L₂₁'s error is the residual's rounding, as a solve's.

What it replaced on a GPU (jax 0.11, jaxlib's ``jaxlib/gpu/solver_kernels_ffi.cc``; XLA's
``xla/backends/gpu/runtime/triangular_solve_thunk.cc``), per call on a batch:

- ``jnp.linalg.cholesky`` is the custom call ``cusolver_potrf_ffi``. For a batch > 1
  jaxlib copies the input to the output buffer (``cudaMemcpyAsync``), writes an array
  of per-matrix pointers (one kernel) and calls ``cusolverDnSpotrfBatched`` once. That
  call steps through the matrices' columns 16 at a time, each step a kernel over the
  whole batch: the H100 profile of ``small`` at rank 1 (r = 768, commit f44e45c) shows
  ``potrf_cta_lower_batch<float, float, 16>`` 48 times and ``potrf_syrk_*`` 47 times per
  call, about 2r/16 launches. (A batch of one goes to ``cusolverDnSpotrf``.)
- The triangular inverse (``lax.linalg.triangular_solve`` of R against I) is XLA's
  triangular-solve thunk: for a batch > 1 two pointer-array kernels and
  ``cublasStrsmBatched``, which launched ``batch_trsm_left_kernel<float, 64, ...>`` r/64
  times per call (12 at r = 768), at about 40 µs each.

So a Cholesky QR pass asked for about 2r/16 + r/64 + 4 launches (110 at r = 768, 55 at
r = 384), none per matrix but all small; with this one it asks for r/b kernel launches and
6(r/b − 1) matmuls (6 + 30 and 3 + 12), each over the whole batch.
"""
import jax
import jax.numpy as jnp
from jax import lax

from dion_jax.kernels import backend as backend_lib

LEAF = 128  # largest diagonal block: dion_jax.kernels.cholesky.MAX_N
_F32 = lax.Precision.HIGHEST


def block_size(r: int) -> int:
  """The diagonal blocks' size b for an r x r matrix: r rounded up to a power of two ≥ 16, at most 128."""
  return min(LEAF, max(16, 1 << (r - 1).bit_length()))


def _split(n: int, b: int) -> int:
  """Where the recursion cuts n (a multiple of b): halves of whole blocks, the first one larger."""
  return (n // b + 1) // 2 * b


def flops(r: int) -> tuple[int, int]:
  """``(matmul, blocks)`` flops of :func:`inverse_cholesky` on one r x r matrix, 2 per
  multiply-add: the recursion's dense matmuls as executed, on G padded to whole blocks
  (4·h·(n − h)·(n + h) per cut of n at h: L₂₁, its refinement's two products, S and
  X₂₁'s two), and b³/3 + b³/3 per diagonal block (its Cholesky and triangular inverse;
  the kernel's masked tiles execute more)."""
  b = block_size(r)

  def matmul(n):
    if n == b:
      return 0
    h = _split(n, b)
    return 4 * h * (n - h) * (n + h) + matmul(h) + matmul(n - h)

  n = -(-r // b) * b
  return matmul(n), (n // b) * 2 * b**3 // 3


def _mm(spec, a, b):
  return jnp.einsum(spec, a, b, precision=_F32, preferred_element_type=jnp.float32)


def _lower(M11, M21, M22):
  """The lower-triangular [M₁₁ 0; M₂₁ M₂₂]."""
  top = jnp.concatenate([M11, jnp.zeros((M11.shape[0], M11.shape[1], M22.shape[2]), jnp.float32)], axis=2)
  return jnp.concatenate([top, jnp.concatenate([M21, M22], axis=2)], axis=1)


def _cholesky_and_inverse(A_bxnxn, b, leaf):
  """``(L, X)``, L = chol(A) and X = L⁻¹ (lower), for n a multiple of b, by the recursion
  of the module docstring."""
  n = A_bxnxn.shape[-1]
  if n == b:
    return leaf(A_bxnxn)
  h = _split(n, b)
  A21 = A_bxnxn[:, h:, :h]
  L11, X11 = _cholesky_and_inverse(A_bxnxn[:, :h, :h], b, leaf)
  L21 = _mm("bij,bkj->bik", A21, X11)
  L21 = L21 + _mm("bij,bkj->bik", A21 - _mm("bij,bkj->bik", L21, L11), X11)
  L22, X22 = _cholesky_and_inverse(A_bxnxn[:, h:, h:] - _mm("bik,bjk->bij", L21, L21), b, leaf)
  X21 = -_mm("bij,bjk->bik", X22, _mm("bij,bjk->bik", L21, X11))
  return _lower(L11, L21, L22), _lower(X11, X21, X22)


def inverse_cholesky(G_bxrxr: jax.Array, *, backend: str = "auto") -> jax.Array:
  """W = R⁻¹ (upper triangular) with G = RᵀR, for every matrix of (B, r, r); float32.

  A G that is not positive definite to float32 gives NaN in W (a pivot's square root),
  as ``jnp.linalg.cholesky`` does. ``backend`` picks the diagonal blocks' kernel
  (``dion_jax.kernels.backend.cholesky_and_inverse``).
  """
  r = G_bxrxr.shape[-1]
  b = block_size(r)
  n = -(-r // b) * b
  pad_eye = jnp.diag(jnp.arange(n) >= r).astype(jnp.float32)  # an identity block decouples the padding
  A_bxnxn = jnp.pad(G_bxrxr.astype(jnp.float32), ((0, 0), (0, n - r), (0, n - r))) + pad_eye
  _, X_bxnxn = _cholesky_and_inverse(A_bxnxn, b, backend_lib.cholesky_and_inverse(backend))
  return jnp.swapaxes(X_bxnxn[:, :r, :r], 1, 2)
