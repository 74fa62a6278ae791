"""Orthonormalization of the tall factor P (m x r, m >= r) in Dion's power iteration.

``"auto"`` (the default) picks ``"shifted_cqr"`` on a GPU and ``"rcqr"`` elsewhere
(:func:`resolve_method`). Four methods return a float32 matrix with orthonormal columns that spans
the column space of ``P`` (up to the signs of the columns, the Q factor of P's QR), a
fifth (``"polar"``) an approximately orthonormal one:

- ``"shifted_cqr"`` (the default on a GPU): Cholesky QR in four passes, every one of them
  batched over the matrices of a step (a Gram matmul, the inverse Cholesky factor of the
  r x r Gram, a matmul by it), with no loop and no branch::

      P₀ = P + ε·‖P‖_F/√r · Ω                               fill, ε = 2e-7
      Pᵢ₊₁ = Pᵢ Rᵢ⁻¹,  Rᵢ = chol(PᵢᵀPᵢ + sᵢ I)                i = 0, 1, 2, 3
      sᵢ = u·‖Pᵢ‖_F² for i = 0, 1 (shifted), 0 for i = 2, 3

  with u float32's machine epsilon and Ω (m x r) a fixed matrix with orthonormal
  columns (column j has random signs on the rows ≡ j mod r). The fill makes the
  result the exact QR of a matrix within 2e-7 of P: P's directions below 2e-7 of
  its norm (rank deficiency, float32 noise) become Ω's, just as Householder QR's
  rounding turns them into arbitrary directions, and the condition number stays
  below ~1e7. The two shifted passes (shifted Cholesky QR, Fukaya et al. 2020,
  arXiv 1809.11085) never fail on such a matrix and bring it to a condition number
  of ~1e3; the two plain passes (Cholesky QR2) then orthonormalize to float32
  rounding. Measured against Householder in float64 at m x r = 300 x 40, 64 x 64,
  512 x 128, cond 1..1e12, duplicated or zero columns: ‖QᵀQ − I‖₂ ≤ 8e-7 and
  ‖(I − QQᵀ)P‖/‖P‖ ≤ 1.1e-6 (Householder: 1.1e-6 and 3e-7). With one shifted pass
  instead of two, or three passes in all, square P of condition ≥ 1e9 gave NaN or
  ‖QᵀQ − I‖ up to 1e-3. Each pass's factor Rᵢ⁻¹ comes whole from
  ``dion_jax.linalg.cholesky.inverse_cholesky``: one Triton launch per 128-column
  diagonal block for the whole batch and a few batched matmuls, where cuSOLVER's batched
  Cholesky and cuBLAS's batched triangular inverse took about 2r/16 + r/64 launches
  (issue 44); pass by pass it is as orthonormal as the LAPACK factor
  (``benchmarks/results/dion_gpu_path/qr_accuracy.md``).
- ``"cqr"``: Cholesky QR in one pass, ``R = chol(PᵀP)``, ``P R⁻¹``, per matrix where
  its Cholesky succeeds and ``use_cqr`` is true (Dion enables it after
  ``cqr_warmup_steps``), ``"shifted_cqr"`` elsewhere. Both are computed and selected:
  no branch on device values (on a GPU a conditional copies its predicate to the
  host), so ``"cqr"`` costs more than ``"shifted_cqr"``; it keeps the reference's
  one-pass Cholesky QR selectable.
- ``"rcqr"`` (the default elsewhere): randomized Cholesky QR (the reference's default). With a Gaussian
  sketch S (k x m), ``k = ceil(oversample·r/128)·128``:

      R₁ = qr_r(S P),  P₁ = P R₁⁻¹,  R₂ = chol(P₁ᵀP₁),  P₂ = P₁ R₂⁻¹.

  S P is a subspace embedding, so P₁ is already well conditioned and the Cholesky
  pass finishes the job. Square P goes to Householder QR. Its Householder QRs run one
  matrix at a time (``dion_jax.kernels.lapack``).
- ``"qr"``: Householder QR (``jnp.linalg.qr``), one matrix at a time.
- ``"polar"``: P's polar factor by Polar Express in bfloat16, as Muon's
  (``dion_jax.linalg.polar``; the Gram steps on r x r where m ≥ 2r): matmuls only, no
  factorization and no launch per block. It spans P's column space but for bfloat16's
  rounding, and its columns are orthonormal only to the polynomials' band: singular
  values 0.82 .. 1.33 at condition ≤ 10, and P's directions below ~1e-3 of its norm are
  not lifted to 1 (‖QᵀQ − I‖₂ 0.28 at condition 1, up to 1 on ill-conditioned P). A
  different basis of the span than QR's (Dion's column normalization of R sees the
  basis), and it trains worse (docs/design.md §4).

Every matmul of the Cholesky passes and of the sketch runs at ``Precision.HIGHEST``
(float32, not the TF32 XLA uses by default on recent GPUs), unless ``precision=
"tensorfloat32x3"`` puts the passes' Grams and products ``P W`` (nearly all their flops; the
inverse factor's recursion stays float32) on the tensor cores as three TF32 products each
(``dion_jax.linalg.tf32``): float32's accuracy, measured pass by pass in
``benchmarks/results/dion_gpu_path/qr_accuracy.md``.

Distribution: when the rows of P are sharded over mesh axes ``axis_name`` (inside a
``shard_map``), the (k x r) sketch product and the (r x r) Gram matrices are summed
over those axes; everything else is local. The sketch entries and the fill Ω are
functions of the global row index (``dion_jax.kernels.sketch``), so the result does
not depend on the number of shards.

RCQR's passes over P (sketch, solve + Gram, solve) dispatch to Pallas GPU kernels
(``dion_jax.kernels.rcqr``) or to their XLA composition (``dion_jax.kernels.rcqr_xla``),
chosen by ``backend``; Cholesky QR's are XLA matmuls, and ``backend`` picks the kernel of
its diagonal blocks (``dion_jax.kernels.backend.inverse_cholesky``: ``"auto"`` is Pallas on
a GPU).
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from dion_jax import validation
from dion_jax.kernels import backend as backend_lib
from dion_jax.kernels import lapack, sketch
from dion_jax.linalg import cholesky, polar, tf32
from dion_jax.parallel import collectives

Method = Literal["auto", "shifted_cqr", "cqr", "rcqr", "qr", "polar"]
AxisName = collectives.Axes

METHODS = ("auto", "shifted_cqr", "cqr", "rcqr", "qr", "polar")


def resolve_method(method: str) -> str:
  """``"auto"``: ``"shifted_cqr"`` on a GPU, ``"rcqr"`` elsewhere (decided when traced).

  On a GPU, RCQR's Householder QRs run one matrix at a time and dominate Dion's step;
  on a CPU they are cheap and RCQR's fewer flops win: a Dion step over the matrices of
  a 4-layer d=512 GPT took 244 ms with RCQR and 335 ms with shifted Cholesky QR at rank
  1/4, 1912 and 2142 ms at full rank (``benchmarks.dion_step``, interleaved).
  """
  if method == "auto":
    return "shifted_cqr" if jax.default_backend() == "gpu" else "rcqr"
  return method

FILL = 2e-7  # Relative size of the fill Ω of "shifted_cqr" (module docstring).
_FILL_SEED = 0x5CA1AB1E  # Ω is the same in every step: it only has to be generic.
_SHIFTED_PASSES = (True, True, False, False)


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


def fill_columns(m_local: int, r: int, axis_name: AxisName = None) -> jax.Array:
  """This shard's rows of Ω (m x r), whose orthonormal columns have disjoint supports:
  column j is ±1/√(rows ≡ j mod r) on the global rows ≡ j (mod r), with signs hashed
  from the global row index. (m_local, r) float32."""
  m = m_local * collectives.axis_size(axis_name)
  row_1xm = collectives.axis_index(axis_name) * m_local + jnp.arange(m_local)[None, :]
  col_rx1 = jnp.arange(r)[:, None]
  negative = (sketch.mix_seed(_FILL_SEED, row_1xm) >> 31) == 1
  sign_1xm = jnp.where(negative, -1.0, 1.0).astype(jnp.float32)
  rows_in_col_rx1 = ((m - 1 - col_rx1) // r + 1).astype(jnp.float32)
  Omega_rxm = jnp.where(row_1xm % r == col_rx1, sign_1xm / jnp.sqrt(rows_in_col_rx1), 0.0)
  return Omega_rxm.T


def _gram(P_bxmxr: jax.Array, precision: str) -> jax.Array:
  return tf32.einsum("bmr,bms->brs", P_bxmxr, P_bxmxr, precision)


def _times(P_bxmxr: jax.Array, W_bxrxr: jax.Array, precision: str) -> jax.Array:
  return tf32.einsum("bmr,brs->bms", P_bxmxr, W_bxrxr, precision)


def _frobenius_sq(G_bxrxr: jax.Array) -> jax.Array:
  return jnp.trace(G_bxrxr, axis1=1, axis2=2)[:, None, None]


def shifted_cholesky_qr_passes(P_bxmxr: jax.Array, *, axis_name: AxisName = None, backend: str = "auto",
                               precision: str = "float32") -> list[jax.Array]:
  """P after each pass of ``"shifted_cqr"`` (module docstring) on a batch of B matrices
  (B, m, r), every pass batched; four float32 (B, m, r), the last orthonormal. ``precision``:
  the passes' Grams and products ``P W`` (``dion_jax.linalg.tf32.einsum``)."""
  _, m_local, r = P_bxmxr.shape
  P_bxmxr = P_bxmxr.astype(jnp.float32)
  rms_col_bx1x1 = jnp.sqrt(collectives.psum(jnp.sum(P_bxmxr**2, axis=(1, 2), keepdims=True), axis_name) / r)
  P_bxmxr = P_bxmxr + (FILL * rms_col_bx1x1) * fill_columns(m_local, r, axis_name)
  eye = jnp.eye(r, dtype=jnp.float32)
  u = float(jnp.finfo(jnp.float32).eps)
  passes = []
  for shifted in _SHIFTED_PASSES:
    G_bxrxr = collectives.psum(_gram(P_bxmxr, precision), axis_name)
    shift = u * _frobenius_sq(G_bxrxr) if shifted else 0.0
    P_bxmxr = _times(P_bxmxr, cholesky.inverse_cholesky(G_bxrxr + shift * eye, backend=backend), precision)
    passes.append(P_bxmxr)
  return passes


def shifted_cholesky_qr(P_bxmxr: jax.Array, *, axis_name: AxisName = None, backend: str = "auto",
                        precision: str = "float32") -> jax.Array:
  """``"shifted_cqr"`` (module docstring) of a batch of B matrices (B, m, r), every
  pass batched; returns float32 (B, m, r). An all-zero P gives NaN (Dion's all-zero
  guard replaces it)."""
  return shifted_cholesky_qr_passes(P_bxmxr, axis_name=axis_name, backend=backend, precision=precision)[-1]


def cholesky_qr_batch(
    P_bxmxr: jax.Array,
    *,
    use_cqr: jax.Array | bool = True,
    axis_name: AxisName = None,
    backend: str = "auto",
    precision: str = "float32",
) -> jax.Array:
  """``"cqr"`` of a batch: one-pass Cholesky QR where its Cholesky is finite and
  ``use_cqr`` holds, :func:`shifted_cholesky_qr` elsewhere, chosen per matrix by a
  select. Both return P's Q factor up to column signs, which Dion's update does not
  see (P Rᵀ and P Qᵀ with R = Bᵀ P are unchanged when a column of P flips)."""
  P32_bxmxr = P_bxmxr.astype(jnp.float32)
  W_bxrxr = cholesky.inverse_cholesky(collectives.psum(_gram(P32_bxmxr, precision), axis_name), backend=backend)
  ok_bx1x1 = jnp.logical_and(jnp.all(jnp.isfinite(W_bxrxr), axis=(1, 2), keepdims=True), use_cqr)
  one_pass = _times(P32_bxmxr, jnp.where(ok_bx1x1, W_bxrxr, jnp.eye(W_bxrxr.shape[-1], dtype=jnp.float32)), precision)
  shifted = shifted_cholesky_qr(P32_bxmxr, axis_name=axis_name, backend=backend, precision=precision)
  return jnp.where(ok_bx1x1, one_pass, shifted)


def orthonormalize_batch(
    P_bxmxr: jax.Array,
    *,
    method: Method = "auto",
    seed: jax.Array | int = 0,
    oversample: float = 1.25,
    use_cqr: jax.Array | bool = True,
    axis_name: AxisName = None,
    backend: str = "auto",
    precision: str = "float32",
) -> jax.Array:
  """:func:`orthonormalize` on each of a batch of B matrices (B, m, r); float32 (B, m, r)."""
  validation.check_choice("qr_method", method, METHODS)
  validation.check_choice("backend", backend, backend_lib.BACKENDS)
  validation.check_choice("precision", precision, tf32.PRECISIONS)
  method = resolve_method(method)
  if method == "shifted_cqr":
    return shifted_cholesky_qr(P_bxmxr, axis_name=axis_name, backend=backend, precision=precision)
  if method == "cqr":
    return cholesky_qr_batch(P_bxmxr, use_cqr=use_cqr, axis_name=axis_name, backend=backend, precision=precision)
  if method == "qr":
    return jax.vmap(lambda P: householder(P, axis_name))(P_bxmxr)
  if method == "polar":
    return polar.polar_factor(P_bxmxr, dtype=jnp.bfloat16, gram=True, axis_name=axis_name, backend=backend)
  rcqr_one = lambda P: rcqr(P, seed, oversample=oversample, axis_name=axis_name, backend=backend)
  return jax.vmap(rcqr_one)(P_bxmxr)


def orthonormalize(
    P_mxr: jax.Array,
    *,
    method: Method = "auto",
    seed: jax.Array | int = 0,
    oversample: float = 1.25,
    use_cqr: jax.Array | bool = True,
    axis_name: AxisName = None,
    backend: str = "auto",
    precision: str = "float32",
) -> jax.Array:
  """Orthonormalizes the columns of ``P`` (m x r, m >= r) with ``method``; returns float32 (m x r).

  Args:
    P_mxr: the matrix, or this device's block of rows of it when ``axis_name`` is set.
    method: ``"auto"`` (:func:`resolve_method`), ``"shifted_cqr"``, ``"cqr"``, ``"rcqr"`` or
      ``"qr"`` (see the module docstring).
    seed: uint32 seed of the RCQR sketch; the same seed gives the same sketch.
    oversample: sketch rows per column of P, before rounding up to a multiple of 128.
    use_cqr: for ``"cqr"`` only: when false, run ``"shifted_cqr"`` instead (warmup).
    axis_name: mesh axes over which the rows of ``P`` are sharded, inside ``shard_map``.
    backend: ``"xla"``, ``"pallas"``, or ``"auto"`` (Pallas on GPU, else XLA).
    precision: the Grams and products ``P W`` of ``"shifted_cqr"`` and ``"cqr"``:
      ``"float32"`` or ``"tensorfloat32x3"`` (``dion_jax.linalg.tf32``).
  """
  return orthonormalize_batch(
      P_mxr[None], method=method, seed=seed, oversample=oversample, use_cqr=use_cqr,
      axis_name=axis_name, backend=backend, precision=precision,
  )[0]  # fmt: skip
