"""Orthonormalization of Dion's P: shifted Cholesky QR, one-pass Cholesky QR with its fallback,
randomized Cholesky QR, Householder, Polar Express; against float64 NumPy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dion_jax.kernels import lapack
from dion_jax.linalg import qr
from tests import stablehlo_calls

M_ROWS, RANK = 300, 40


def _with_condition(cond, m=M_ROWS, r=RANK, seed=0):
  """float32 (m, r) with singular values logspaced from 1 to 1/cond, and its exact left factor."""
  rng = np.random.default_rng(seed)
  U_mxr = np.linalg.qr(rng.normal(size=(m, r)))[0]
  V_rxr = np.linalg.qr(rng.normal(size=(r, r)))[0]
  sigma_r = np.logspace(0, -np.log10(cond), r)
  return jnp.asarray((U_mxr * sigma_r) @ V_rxr.T, jnp.float32), U_mxr


def _orthonormality_error(Q_mxr):
  Q = np.asarray(Q_mxr, np.float64)
  return np.linalg.norm(Q.T @ Q - np.eye(Q.shape[1]), 2)


def _span_residual(Q_mxr, P_mxr):
  """‖(I − Q Qᵀ) P‖ / ‖P‖: how much of P lies outside the span of Q."""
  Q, A = np.asarray(Q_mxr, np.float64), np.asarray(P_mxr, np.float64)
  return np.linalg.norm(A - Q @ (Q.T @ A)) / np.linalg.norm(A)


def _cholesky_fails(P_mxr):
  P32 = P_mxr.astype(jnp.float32)
  return bool(jnp.any(jnp.isnan(jnp.linalg.cholesky(P32.T @ P32))))


# Two differently compiled programs (jit vs vmap, batched vs not) round differently, so
# the same algorithm's Q is compared within what rounding moves it: a relative 6e-8
# perturbation of P (one float32 ulp) moves RCQR's Q by 1.2e-7 on well-conditioned P and
# by up to 6e-3 on P of condition 1e6 or with two columns equal to 1e-5; another sketch
# seed, i.e. a different computation, moves it by 0.4 and Cholesky QR's Q differs from
# RCQR's by 0.47. The bounds are ~10x the rounding sensitivity.
SAME_Q_WELL_CONDITIONED = 1e-6
SAME_Q_ILL_CONDITIONED = 5e-2


def _ortho(P_mxr, method, **kwargs):
  return qr.orthonormalize(P_mxr, method=method, seed=11, backend="xla", **kwargs)


@pytest.mark.parametrize("cond", [1.0, 1e3, 1e6])
@pytest.mark.parametrize("method", ["shifted_cqr", "qr", "rcqr"])
def test_stable_methods_are_orthonormal(method, cond):
  P_mxr, _ = _with_condition(cond)
  Q_mxr = _ortho(P_mxr, method)
  assert Q_mxr.dtype == jnp.float32 and Q_mxr.shape == P_mxr.shape
  assert _orthonormality_error(Q_mxr) < 1e-5
  assert _span_residual(Q_mxr, P_mxr) < 1e-5


@pytest.mark.parametrize("cond", [1.0, 10.0])
def test_cqr_on_well_conditioned_input(cond):
  P_mxr, _ = _with_condition(cond)
  assert not _cholesky_fails(P_mxr)
  Q_mxr = _ortho(P_mxr, "cqr", use_cqr=True)
  assert _orthonormality_error(Q_mxr) < 1e-5
  assert _span_residual(Q_mxr, P_mxr) < 1e-5
  # Cholesky QR's Q has R with a positive diagonal, as Householder's up to column signs.
  Q_ref = np.asarray(jnp.linalg.qr(P_mxr)[0])
  signs = np.sign(np.sum(Q_ref * np.asarray(Q_mxr), axis=0))
  np.testing.assert_allclose(np.asarray(Q_mxr), Q_ref * signs, atol=1e-5)


def test_span_of_well_conditioned_input_is_exact():
  P_mxr, U_mxr = _with_condition(1e3)
  for method in ("shifted_cqr", "qr", "rcqr"):
    Q = np.asarray(_ortho(P_mxr, method), np.float64)
    sin_max_angle = np.linalg.norm(U_mxr - Q @ (Q.T @ U_mxr), 2)
    assert sin_max_angle < 1e-3, method  # float32 rounding of P times its condition number


def _rank_deficient(kind, m=M_ROWS, r=RANK):
  """float32 (m, r): a duplicated or zero column, or rank r/2 exactly."""
  P_mxr, _ = _with_condition(10.0, m, r)
  if kind == "duplicate":
    return P_mxr.at[:, 1].set(P_mxr[:, 0])
  if kind == "zero_column":
    return P_mxr.at[:, 3].set(0.0)
  rng = np.random.default_rng(1)
  return jnp.asarray(rng.normal(size=(m, r // 2)) @ rng.normal(size=(r // 2, r)), jnp.float32)


def _householder_f64(P_mxr):
  """Float64 Householder Q with R's diagonal made positive, and R's relative diagonal."""
  Q, R = np.linalg.qr(np.asarray(P_mxr, np.float64))
  signs = np.where(np.diag(R) < 0, -1.0, 1.0)
  return Q * signs, np.abs(np.diag(R)) / np.linalg.norm(np.asarray(P_mxr, np.float64), 2)


@functools.cache
def _shifted_cqr_and_third_pass(precision):
  """Shifted Cholesky QR's Q of P (m, r) and its third pass's, one program per shape: eagerly,
  each call would compile its loops anew (a second a case)."""
  def both(P_mxr):
    third = qr.shifted_cholesky_qr_passes(P_mxr[None], backend="xla", precision=precision)[2][0]
    return _ortho(P_mxr, "shifted_cqr", precision=precision), third
  return jax.jit(both)


@pytest.mark.parametrize("precision", ["float32", "tensorfloat32x3"])
@pytest.mark.parametrize("shape", [(M_ROWS, RANK), (64, 64)], ids=["tall", "square"])
@pytest.mark.parametrize("P_kind", ["cond1", "cond1e3", "cond1e6", "cond1e9", "cond1e12", "duplicate",
                                    "zero_column", "half_rank"])
def test_shifted_cqr_is_householder_in_float64_up_to_the_fill(P_kind, shape, precision):
  """Orthonormal to float32 rounding whatever P's condition or rank, with the passes' Grams
  and products in float32 or as three TF32 products (emulated here); P's span kept to ~1e-6
  (its fill); each column whose direction P determines (relative pivot > 1e-3) equal to
  float64 Householder's up to sign."""
  m, r = shape
  if P_kind.startswith("cond"):
    P_mxr, _ = _with_condition(float(P_kind[4:]), m, r)
  else:
    P_mxr = _rank_deficient(P_kind, m, r)
  Q_mxr, third = _shifted_cqr_and_third_pass(precision)(P_mxr)
  assert Q_mxr.dtype == jnp.float32 and Q_mxr.shape == P_mxr.shape
  # Achieved at most 8e-7 and 1.1e-6 on such inputs (float32 Householder: 1.1e-6 and 3e-7).
  assert _orthonormality_error(Q_mxr) < 5e-6
  # The fourth pass is needed: the third leaves up to 5.0e-2 (square, cond 1e9), 2.9e-5 (tall).
  assert _orthonormality_error(third) < (0.1 if m == r else 1e-4)
  assert _span_residual(Q_mxr, P_mxr) < 1e-5
  Q_ref, pivot = _householder_f64(P_mxr)
  determined = np.flatnonzero(pivot > 1e-3)
  determined = determined[: np.argmin(np.r_[pivot > 1e-3, False])]  # before the first degenerate column
  Q = np.asarray(Q_mxr, np.float64)[:, determined]
  signs = np.sign(np.sum(Q * Q_ref[:, determined], axis=0))
  # Achieved ≤ 1e-6 at cond 1, ≤ 2e-4 at cond ≥ 1e3: the fill (2e-7) over the column's pivot.
  tol = 1e-5 if P_kind == "cond1" else 2e-3
  np.testing.assert_allclose(Q * signs, Q_ref[:, determined], atol=tol)


@pytest.mark.parametrize("P_kind", ["ill_conditioned", "nearly_rank_deficient"])
def test_cqr_falls_back_to_shifted_cqr_when_cholesky_fails(P_kind):
  if P_kind == "ill_conditioned":
    P_mxr, _ = _with_condition(1e6)
  else:  # one column a copy of another, up to a relative perturbation of 1e-5
    P_mxr, _ = _with_condition(1.0)
    P_mxr = P_mxr.at[:, 1].set(P_mxr[:, 0] + 1e-5 * P_mxr[:, 1])
  assert _cholesky_fails(P_mxr)  # the precondition: the float32 Gram Cholesky gives NaN
  Q_cqr = _ortho(P_mxr, "cqr", use_cqr=True)
  np.testing.assert_allclose(Q_cqr, _ortho(P_mxr, "shifted_cqr"), atol=SAME_Q_WELL_CONDITIONED)
  assert _orthonormality_error(Q_cqr) < 5e-6
  assert _span_residual(Q_cqr, P_mxr) < 1e-5


def test_batched_cqr_selects_per_matrix_without_a_branch():
  good = [_with_condition(10.0, seed=s)[0] for s in range(3)]
  bad, _ = _with_condition(1e6, seed=3)
  assert _cholesky_fails(bad) and not any(_cholesky_fails(p) for p in good)
  jitted = jax.jit(lambda P, use_cqr: qr.cholesky_qr_batch(P, use_cqr=use_cqr, backend="xla"))
  batch = lambda Ps, use_cqr=True: jitted(jnp.stack(Ps), use_cqr)  # noqa: E731
  one_pass = jnp.concatenate([jitted(p[None], True) for p in good])  # each matrix alone
  np.testing.assert_allclose(batch(good), one_pass, atol=1e-6)
  # One Cholesky fails: that matrix alone gets shifted Cholesky QR.
  mixed = batch(good + [bad])
  np.testing.assert_allclose(mixed[:3], one_pass, atol=1e-6)
  shifted_cqr = jax.jit(lambda P: qr.shifted_cholesky_qr(P, backend="xla"))
  # Condition 1e6: batched or alone, XLA's rounding moves Q by up to 4.5e-6 (jax 0.12); the
  # one-pass Cholesky QR it must not take gives NaN.
  np.testing.assert_allclose(mixed[3], shifted_cqr(bad[None])[0], atol=1e-5)
  shifted = shifted_cqr(jnp.stack(good))
  np.testing.assert_allclose(batch(good, use_cqr=False), shifted, atol=1e-6)
  jaxpr = str(jax.make_jaxpr(lambda P: qr.cholesky_qr_batch(P, backend="xla"))(jnp.stack(good)))
  assert "cond[" not in jaxpr and "select_n" in jaxpr


def test_cqr_during_warmup_is_shifted_cqr():
  P_mxr, _ = _with_condition(1.0)
  np.testing.assert_allclose(_ortho(P_mxr, "cqr", use_cqr=False), _ortho(P_mxr, "shifted_cqr"), atol=SAME_Q_WELL_CONDITIONED)
  # use_cqr may be traced (Dion passes count > warmup): one compiled function, both branches.
  f = jax.jit(lambda p, flag: _ortho(p, "cqr", use_cqr=flag))
  np.testing.assert_allclose(f(P_mxr, False), _ortho(P_mxr, "shifted_cqr"), atol=SAME_Q_WELL_CONDITIONED)
  np.testing.assert_allclose(f(P_mxr, True), _ortho(P_mxr, "cqr", use_cqr=True), atol=1e-6)


@pytest.mark.parametrize("method", ["auto", "shifted_cqr", "cqr", "polar", "rcqr"])
def test_lowered_for_cuda_shifted_and_one_pass_cqr_loop_over_no_matrix(monkeypatch, method, h100):
  """Lowered for CUDA as on a GPU: shifted (``"auto"`` there) and one-pass Cholesky QR
  factor each pass's Grams by one Triton launch for the whole batch (r = 16: one diagonal
  block), with no cuSOLVER or cuBLAS factorization, no loop and no conditional, and every
  matmul at HIGHEST precision; polar asks for no factorization at all; RCQR's Householder
  QR of the sketch loops over the matrices (the test bites)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # read when traced
  P_bxmxr = jnp.stack([_with_condition(10.0, m=64, r=16, seed=s)[0] for s in range(3)])
  f = lambda P: qr.orthonormalize_batch(P, method=method)  # noqa: E731
  lowered = jax.jit(f).trace(P_bxmxr).lower(lowering_platforms=("cuda",))
  reached = stablehlo_calls.reached_ops(lowered)
  if method == "rcqr":
    assert "cusolver_geqrf_ffi" in stablehlo_calls.factorizations_in_loops(reached)
    return
  passes = {"auto": 4, "shifted_cqr": 4, "cqr": 5, "polar": 0}[method]
  assert [r.op for r in reached] == ["__gpu$xla.gpu.triton"] * passes, reached
  dots = [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]
  if method == "polar":
    assert dots and all("xbf16>" in line and "HIGHEST" not in line for line in dots), dots
  else:
    assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots), dots


@pytest.mark.parametrize("method,tall_dots", [("shifted_cqr", 8), ("cqr", 10)])
def test_lowered_for_cuda_tensorfloat32x3_puts_the_tall_products_on_tensor_cores(monkeypatch, method, tall_dots, h100):
  """``precision="tensorfloat32x3"`` as on a GPU: every pass's Gram and ``P W`` (the dots
  with P's 300 rows) carry XLA's ``TF32_TF32_F32_X3`` algorithm; the inverse factor's
  recursion (r = 256: two diagonal blocks) stays at HIGHEST; nothing is emulated."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # read when traced
  P_bxmxr = _with_condition(10.0, m=300, r=256)[0][None]
  f = lambda P: qr.orthonormalize_batch(P, method=method, precision="tensorfloat32x3")  # noqa: E731
  text = jax.jit(f).trace(P_bxmxr).lower(lowering_platforms=("cuda",)).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  tall = [line for line in dots if "300x256x" in line.split("->")[0]]
  assert len(tall) == tall_dots and all("num_primitive_operations = 3" in line for line in tall), dots
  rest = [line for line in dots if line not in tall]
  assert rest and all("precision = [HIGHEST, HIGHEST]" in line for line in rest), rest
  assert "bitcast_convert" not in text


@pytest.mark.parametrize("shape", [(300, 40), (256, 32), (64, 64)], ids=["gram", "gram_square_steps", "square"])
@pytest.mark.parametrize("cond", [1.0, 10.0])
def test_polar_is_orthonormal_to_bfloat16_and_polar_express(shape, cond):
  """Polar Express in bfloat16 (Gram steps on 300 x 40 and 256 x 32, standard ones on the
  square): Q's singular values within its polynomials' band around 1, and its columns in
  P's span but for bfloat16's rounding, which the polynomials lift with P's directions."""
  P_mxr, _ = _with_condition(cond, *shape)
  Q = np.asarray(_ortho(P_mxr, "polar"), np.float64)
  sigma = np.linalg.svd(Q, compute_uv=False)
  assert 0.8 < sigma.min() and sigma.max() < 1.4  # reached 0.82 .. 1.33
  U = np.linalg.qr(np.asarray(P_mxr, np.float64))[0]
  assert np.linalg.norm(Q - U @ (U.T @ Q), 2) < 0.02  # reached 0.016 (cond 10), 0.006 (cond 1)


def test_auto_is_shifted_cqr_on_a_gpu_and_rcqr_elsewhere(monkeypatch):
  assert qr.resolve_method("auto") == "rcqr" and qr.resolve_method("qr") == "qr"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert qr.resolve_method("auto") == "shifted_cqr"


def test_fill_columns_are_orthonormal_and_split_like_the_rows():
  Omega = np.asarray(qr.fill_columns(50, 16), np.float64)
  np.testing.assert_allclose(Omega.T @ Omega, np.eye(16), atol=1e-6)
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  local = jax.shard_map(lambda: qr.fill_columns(25, 16, "tp"), mesh=mesh, in_specs=(), out_specs=P("tp", None))
  np.testing.assert_allclose(jax.jit(local)(), Omega, atol=1e-7)  # reached: 0 (same entries, sharded)


@pytest.mark.parametrize("shape", [(16, 16), (40, 40)])
def test_square_rcqr_is_householder(shape):
  P_mxr = jnp.asarray(np.random.default_rng(2).normal(size=shape), jnp.float32)
  np.testing.assert_allclose(_ortho(P_mxr, "rcqr"), jnp.linalg.qr(P_mxr)[0], atol=1e-6)


def test_rcqr_depends_on_the_seed_only_through_rounding():
  P_mxr, _ = _with_condition(1e3)
  Q1 = qr.orthonormalize(P_mxr, method="rcqr", seed=1, backend="xla")
  Q2 = qr.orthonormalize(P_mxr, method="rcqr", seed=2, backend="xla")
  assert not np.array_equal(Q1, Q2)
  signs = np.sign(np.sum(np.asarray(Q1) * np.asarray(Q2), axis=0))
  np.testing.assert_allclose(np.asarray(Q1), np.asarray(Q2) * signs, atol=1e-4)


def test_unknown_method_or_backend():
  P_mxr, _ = _with_condition(1.0)
  with pytest.raises(ValueError, match="qr_method"):
    qr.orthonormalize(P_mxr, method="svd")
  with pytest.raises(ValueError, match="backend"):
    qr.orthonormalize(P_mxr, backend="tpu")


@pytest.mark.parametrize("method", ["shifted_cqr", "qr", "cqr", "rcqr", "polar"])
def test_row_sharded_equals_unsharded(method):
  """Rows split over a 4-way "tp" axis give the rows of the one-device result."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
  P_mxr, _ = _with_condition(10.0, m=256, r=32)

  def local(p):
    return qr.orthonormalize(p, method=method, seed=5, axis_name="tp", backend="xla")

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))
  Q_sharded = sharded(P_mxr)
  Q_single = jax.jit(lambda p: qr.orthonormalize(p, method=method, seed=5, backend="xla"))(P_mxr)
  # polar: its sharded Grams are float32 sums rounded once to bfloat16, the one-device Gram a
  # bfloat16 matmul (on this CPU at the tests' XLA flags, less accurate): reached 2.7e-2 after
  # the polynomials (without the sum over the shards: 0.26).
  np.testing.assert_allclose(Q_sharded, Q_single, atol=5e-2 if method == "polar" else 2e-5)


def test_batched_factorizations_run_one_matrix_at_a_time_on_cpu():
  """jaxlib's batched CPU LAPACK kernels can deadlock XLA's thread pool (8 devices,
  several factorizations at once); vmapped, ours must loop instead and agree."""
  A = jnp.asarray(np.random.default_rng(0).normal(size=(4, 24, 8)), jnp.float32)
  f = jax.jit(jax.vmap(lapack.qr_r))
  assert "while" in f.lower(A).compile().as_text()
  np.testing.assert_allclose(np.abs(f(A)), np.abs(jnp.linalg.qr(A, mode="r")), atol=1e-5)
  G = jnp.einsum("bki,bkj->bij", A, A)
  np.testing.assert_allclose(jax.vmap(lapack.upper_inverse)(jnp.linalg.cholesky(G).mT) @ jnp.linalg.cholesky(G).mT,
                             np.broadcast_to(np.eye(8), (4, 8, 8)), atol=1e-4)


def test_qr_loops_over_the_batch_on_gpu_while_cholesky_stays_batched(monkeypatch):
  """cuSOLVER's batched QR kernel took 685 ms for 12 matrices of 768 x 768 on an H100,
  3.5 ms for one: on a GPU, QR loops; Cholesky and triangular solves (1.5 and 1.0 ms
  for the same batch) stay batched."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # read when traced
  A = jnp.ones((4, 24, 8), jnp.float32)
  G = jnp.broadcast_to(jnp.eye(8), (4, 8, 8))
  loops = lambda f, x: "scan" in str(jax.make_jaxpr(jax.vmap(f))(x))  # noqa: E731
  assert loops(lapack.qr_r, A) and loops(lapack.qr_q, A)
  assert not loops(lapack.cholesky_upper, G) and not loops(lapack.upper_inverse, G)
