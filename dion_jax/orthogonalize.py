"""Orthonormalization of the tall factor P (m x r) in Dion's power iteration.

Three methods, each returning a float32 matrix with orthonormal columns that spans
the column space of ``P``:

- ``"qr"``: Householder QR (``jnp.linalg.qr``).
- ``"cqr"``: Cholesky QR, ``R = chol(PᵀP)``, ``P R⁻¹``. Cholesky QR squares the
  condition number, so it only runs when ``use_cqr`` is true (Dion enables it after
  ``cqr_warmup_steps``) and the factorization succeeded; otherwise it falls back to
  ``"rcqr"``. JAX's Cholesky returns NaN instead of raising, which is what we test.
- ``"rcqr"``: randomized Cholesky QR. With a Gaussian sketch S (k x m),
  ``k = ceil(oversample·r/128)·128``:

      R₁ = qr_r(S P),  P₁ = P R₁⁻¹,  R₂ = chol(P₁ᵀP₁),  P₂ = P₁ R₂⁻¹.

  S P is a subspace embedding, so P₁ is already well conditioned and the Cholesky
  pass finishes the job. Square or wide P (m <= r) goes to Householder QR.

Distribution: when the rows of P are sharded over mesh axes ``axis_name`` (inside a
``shard_map``), the (k x r) sketch product and the (r x r) Gram matrix are summed
over those axes; everything else is local. The sketch entries are a function of the
global row index (``dion_jax.sketch``), so the result does not depend on the number
of shards.

The three passes over P (sketch, solve + Gram, solve) are the heavy part; they
dispatch to Pallas GPU kernels (``dion_jax.kernels.rcqr``) or to the XLA composition
below, chosen by ``backend``.
"""

from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from dion_jax import sketch

Method = Literal["qr", "cqr", "rcqr"]
Backend = Literal["auto", "xla", "pallas"]
AxisName = str | Sequence[str] | None

METHODS = ("qr", "cqr", "rcqr")
BACKENDS = ("auto", "xla", "pallas")


def psum(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """``lax.psum`` that is the identity when there is no axis to sum over."""
  return x if not axis_name else lax.psum(x, axis_name)


def _axis_size(axis_name: AxisName) -> int:
  return 1 if not axis_name else lax.psum(1, axis_name)


def _axis_index(axis_name: AxisName) -> jax.Array:
  return jnp.uint32(0) if not axis_name else lax.axis_index(axis_name).astype(jnp.uint32)


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
    Householder kernel (``geqr2_batch_kernel``), meant for tiny matrices: 685 ms for
    12 matrices of 768 x 768 on an H100, against 3.5 ms for one (benchmarks/gpu.py).

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
def _cholesky_upper(G_rxr: jax.Array) -> jax.Array:
  return jnp.linalg.cholesky(G_rxr).T


@one_matrix_at_a_time("cpu", "gpu")
def _qr_r(A_kxr: jax.Array) -> jax.Array:
  return jnp.linalg.qr(A_kxr, mode="r")


@one_matrix_at_a_time("cpu", "gpu")
def _qr_q(A_mxr: jax.Array) -> jax.Array:
  return jnp.linalg.qr(A_mxr)[0]


# --- XLA composition of the three heavy passes -----------------------------------


def xla_sketch_product(P_mxr: jax.Array, seed: jax.Array, k: int, row_start: jax.Array) -> jax.Array:
  """``S[:, row_start:row_start+m] @ P`` with S from ``dion_jax.sketch``; (k, r) float32."""
  S_kxm = sketch.sketch_block(seed, row_start, P_mxr.shape[0], k)
  return jnp.matmul(S_kxm, P_mxr.astype(jnp.float32), preferred_element_type=jnp.float32)


def xla_solve(P_mxr: jax.Array, R_rxr: jax.Array) -> jax.Array:
  """``P R⁻¹`` in float32, as a matmul with the explicit inverse of the small R.

  A CPU trsm of a tall P runs at a fraction of matmul speed (6.5 ms against 1.9 ms
  for 6 x (2048 x 128) here), and the Pallas kernels do the same. The price is
  accuracy in P's weakest directions when R is ill conditioned: on a P whose two
  columns agree to 1e-5, P's span is kept to ~1e-3 instead of ~1e-5 (a rotation
  within directions Dion's update weighs by their tiny singular values anyway).
  """
  return jnp.matmul(P_mxr.astype(jnp.float32), upper_inverse(R_rxr), preferred_element_type=jnp.float32)


def xla_solve_and_gram(P_mxr: jax.Array, R_rxr: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``P₁ = P R⁻¹`` (float32) and its local Gram matrix ``P₁ᵀ P₁``."""
  P1_mxr = xla_solve(P_mxr, R_rxr)
  return P1_mxr, P1_mxr.T @ P1_mxr


def _passes(backend: Backend):
  if backend == "auto":
    backend = "pallas" if jax.default_backend() == "gpu" else "xla"
  if backend == "xla":
    return xla_sketch_product, xla_solve_and_gram, xla_solve
  from dion_jax.kernels import rcqr as pallas_rcqr  # Imported lazily: only the GPU path needs Pallas.

  return pallas_rcqr.sketch_product, pallas_rcqr.solve_and_gram, pallas_rcqr.solve


# --- Methods ----------------------------------------------------------------------


def householder(P_mxr: jax.Array, axis_name: AxisName = None) -> jax.Array:
  """Householder QR's Q factor; a row-sharded P is gathered, factored, and re-split."""
  P_mxr = P_mxr.astype(jnp.float32)
  if not axis_name:
    return _qr_q(P_mxr)
  m_local = P_mxr.shape[0]
  full = lax.all_gather(P_mxr, axis_name, axis=0, tiled=True)
  Q_full = _qr_q(full)
  start = lax.axis_index(axis_name) * m_local
  return lax.dynamic_slice_in_dim(Q_full, start, m_local, axis=0)


def rcqr(
    P_mxr: jax.Array,
    seed: jax.Array,
    *,
    oversample: float = 1.25,
    axis_name: AxisName = None,
    backend: Backend = "auto",
) -> jax.Array:
  """Randomized Cholesky QR of P (rows possibly sharded over ``axis_name``)."""
  m_local, r = P_mxr.shape
  if m_local * _axis_size(axis_name) <= r:
    return householder(P_mxr, axis_name)
  sketch_product, solve_and_gram, solve = _passes(backend)
  k = sketch.sketch_size(r, oversample)
  row_start = _axis_index(axis_name) * jnp.uint32(m_local)
  SP_kxr = psum(sketch_product(P_mxr, jnp.asarray(seed, jnp.uint32), k, row_start), axis_name)
  R1_rxr = _qr_r(SP_kxr)
  P1_mxr, G_rxr = solve_and_gram(P_mxr, R1_rxr)
  R2_rxr = _cholesky_upper(psum(G_rxr, axis_name))
  return solve(P1_mxr, R2_rxr)


def cholesky_qr_batch(
    P_bxmxr: jax.Array,
    seed: jax.Array,
    *,
    use_cqr: jax.Array | bool = True,
    oversample: float = 1.25,
    axis_name: AxisName = None,
    backend: Backend = "auto",
) -> jax.Array:
  """:func:`cholesky_qr` of a batch of matrices, with one decision for the whole batch.

  A per-matrix ``lax.cond`` under ``vmap`` becomes a select that computes both
  branches; deciding once keeps Cholesky QR's saving. When a single Cholesky
  fails (or ``use_cqr`` is false), the whole batch runs :func:`rcqr`. Both return the
  Q factor of P up to the signs of its columns, which Dion's update does not see
  (P Rᵀ and P Qᵀ with R = Bᵀ P are unchanged when a column of P flips).
  """
  P32_bxmxr = P_bxmxr.astype(jnp.float32)
  gram_bxrxr = jnp.einsum("bmr,bms->brs", P32_bxmxr, P32_bxmxr)
  R_bxrxr = jax.vmap(_cholesky_upper)(psum(gram_bxrxr, axis_name))
  ok = jnp.logical_and(jnp.all(jnp.isfinite(R_bxrxr)), use_cqr)
  rcqr_one = lambda P: rcqr(P, seed, oversample=oversample, axis_name=axis_name, backend=backend)
  return lax.cond(
      ok,
      lambda: jax.vmap(_passes(backend)[2])(P32_bxmxr, R_bxrxr),
      lambda: jax.vmap(rcqr_one)(P32_bxmxr),
  )


def cholesky_qr(
    P_mxr: jax.Array,
    seed: jax.Array,
    *,
    use_cqr: jax.Array | bool = True,
    oversample: float = 1.25,
    axis_name: AxisName = None,
    backend: Backend = "auto",
) -> jax.Array:
  """Cholesky QR, falling back to :func:`rcqr` when disabled or when Cholesky fails."""
  kwargs = dict(use_cqr=use_cqr, oversample=oversample, axis_name=axis_name, backend=backend)
  return cholesky_qr_batch(P_mxr[None], seed, **kwargs)[0]


def orthonormalize(
    P_mxr: jax.Array,
    *,
    method: Method = "rcqr",
    seed: jax.Array | int = 0,
    oversample: float = 1.25,
    use_cqr: jax.Array | bool = True,
    axis_name: AxisName = None,
    backend: Backend = "auto",
) -> jax.Array:
  """Orthonormalizes the columns of ``P`` (m x r) with ``method``; returns float32 (m x r).

  Args:
    P_mxr: the matrix, or this device's block of rows of it when ``axis_name`` is set.
    method: ``"qr"``, ``"cqr"`` or ``"rcqr"`` (see the module docstring).
    seed: uint32 seed of the RCQR sketch; the same seed gives the same sketch.
    oversample: sketch rows per column of P, before rounding up to a multiple of 128.
    use_cqr: for ``"cqr"`` only: when false, run ``"rcqr"`` instead (warmup).
    axis_name: mesh axes over which the rows of ``P`` are sharded, inside ``shard_map``.
    backend: ``"xla"``, ``"pallas"``, or ``"auto"`` (Pallas on GPU, else XLA).
  """
  if method not in METHODS:
    raise ValueError(f"qr_method must be one of {METHODS}, got {method!r}")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if method == "qr":
    return householder(P_mxr, axis_name)
  if method == "cqr":
    return cholesky_qr(
        P_mxr, seed, use_cqr=use_cqr, oversample=oversample, axis_name=axis_name, backend=backend
    )
  return rcqr(P_mxr, seed, oversample=oversample, axis_name=axis_name, backend=backend)
