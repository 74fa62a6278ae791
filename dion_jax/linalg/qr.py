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
global row index (``dion_jax.kernels.sketch``), so the result does not depend on the number
of shards.

The three passes over P (sketch, solve + Gram, solve) are the heavy part; they
dispatch to Pallas GPU kernels (``dion_jax.kernels.rcqr``) or to their XLA
composition (``dion_jax.kernels.rcqr_xla``), chosen by ``backend``.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from dion_jax import validation
from dion_jax.kernels import backend as backend_lib
from dion_jax.kernels import lapack, sketch
from dion_jax.parallel import collectives

Method = Literal["qr", "cqr", "rcqr"]
AxisName = collectives.Axes

METHODS = ("qr", "cqr", "rcqr")


def householder(P_mxr: jax.Array, axis_name: AxisName = None) -> jax.Array:
  """Householder QR's Q factor; a row-sharded P is gathered, factored, and re-split."""
  P_mxr = P_mxr.astype(jnp.float32)
  if not axis_name:
    return lapack.qr_q(P_mxr)
  m_local = P_mxr.shape[0]
  full = lax.all_gather(P_mxr, axis_name, axis=0, tiled=True)
  Q_full = lapack.qr_q(full)
  start = lax.axis_index(axis_name) * m_local
  return lax.dynamic_slice_in_dim(Q_full, start, m_local, axis=0)


def rcqr(
    P_mxr: jax.Array,
    seed: jax.Array,
    *,
    oversample: float = 1.25,
    axis_name: AxisName = None,
    backend: str = "auto",
) -> jax.Array:
  """Randomized Cholesky QR of P (rows possibly sharded over ``axis_name``)."""
  m_local, r = P_mxr.shape
  if m_local * collectives.axis_size(axis_name) <= r:
    return householder(P_mxr, axis_name)
  sketch_product, solve_and_gram, solve = backend_lib.rcqr_passes(backend)
  k = sketch.sketch_size(r, oversample)
  row_start = collectives.axis_index(axis_name) * jnp.uint32(m_local)
  SP_kxr = collectives.psum(sketch_product(P_mxr, jnp.asarray(seed, jnp.uint32), k, row_start), axis_name)
  R1_rxr = lapack.qr_r(SP_kxr)
  P1_mxr, G_rxr = solve_and_gram(P_mxr, R1_rxr)
  R2_rxr = lapack.cholesky_upper(collectives.psum(G_rxr, axis_name))
  return solve(P1_mxr, R2_rxr)


def cholesky_qr_batch(
    P_bxmxr: jax.Array,
    seed: jax.Array,
    *,
    use_cqr: jax.Array | bool = True,
    oversample: float = 1.25,
    axis_name: AxisName = None,
    backend: str = "auto",
) -> jax.Array:
  """Cholesky QR of a batch of matrices, with one decision for the whole batch.

  A per-matrix ``lax.cond`` under ``vmap`` becomes a select that computes both
  branches; deciding once keeps Cholesky QR's saving. When a single Cholesky
  fails (or ``use_cqr`` is false), the whole batch runs :func:`rcqr`. Both return the
  Q factor of P up to the signs of its columns, which Dion's update does not see
  (P Rᵀ and P Qᵀ with R = Bᵀ P are unchanged when a column of P flips).
  """
  P32_bxmxr = P_bxmxr.astype(jnp.float32)
  gram_bxrxr = jnp.einsum("bmr,bms->brs", P32_bxmxr, P32_bxmxr)
  R_bxrxr = jax.vmap(lapack.cholesky_upper)(collectives.psum(gram_bxrxr, axis_name))
  ok = jnp.logical_and(jnp.all(jnp.isfinite(R_bxrxr)), use_cqr)
  rcqr_one = lambda P: rcqr(P, seed, oversample=oversample, axis_name=axis_name, backend=backend)
  return lax.cond(
      ok,
      lambda: jax.vmap(backend_lib.rcqr_passes(backend)[2])(P32_bxmxr, R_bxrxr),
      lambda: jax.vmap(rcqr_one)(P32_bxmxr),
  )


def orthonormalize(
    P_mxr: jax.Array,
    *,
    method: Method = "rcqr",
    seed: jax.Array | int = 0,
    oversample: float = 1.25,
    use_cqr: jax.Array | bool = True,
    axis_name: AxisName = None,
    backend: str = "auto",
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
  validation.check_choice("qr_method", method, METHODS)
  validation.check_choice("backend", backend, backend_lib.BACKENDS)
  if method == "qr":
    return householder(P_mxr, axis_name)
  if method == "cqr":
    return cholesky_qr_batch(
        P_mxr[None], seed, use_cqr=use_cqr, oversample=oversample, axis_name=axis_name, backend=backend
    )[0]
  return rcqr(P_mxr, seed, oversample=oversample, axis_name=axis_name, backend=backend)
