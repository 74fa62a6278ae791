"""Orthonormalization of Dion's P: Householder, Cholesky QR with its fallback, randomized Cholesky QR."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dion_jax.kernels import lapack
from dion_jax.linalg import qr

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
@pytest.mark.parametrize("method", ["qr", "rcqr"])
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
  for method in ("qr", "rcqr"):
    Q = np.asarray(_ortho(P_mxr, method), np.float64)
    sin_max_angle = np.linalg.norm(U_mxr - Q @ (Q.T @ U_mxr), 2)
    assert sin_max_angle < 1e-3, method  # float32 rounding of P times its condition number


@pytest.mark.parametrize("P_kind", ["ill_conditioned", "nearly_rank_deficient"])
def test_cqr_falls_back_to_rcqr_when_cholesky_fails(P_kind):
  if P_kind == "ill_conditioned":
    P_mxr, _ = _with_condition(1e6)
  else:  # one column a copy of another, up to a relative perturbation of 1e-5
    P_mxr, _ = _with_condition(1.0)
    P_mxr = P_mxr.at[:, 1].set(P_mxr[:, 0] + 1e-5 * P_mxr[:, 1])
  assert _cholesky_fails(P_mxr)  # the precondition: the float32 Gram Cholesky gives NaN
  Q_cqr = _ortho(P_mxr, "cqr", use_cqr=True)
  Q_rcqr = _ortho(P_mxr, "rcqr")
  np.testing.assert_allclose(Q_cqr, Q_rcqr, atol=SAME_Q_ILL_CONDITIONED)
  assert _orthonormality_error(Q_cqr) < 1e-4
  # Two columns equal to 1e-5: the explicit R⁻¹ of the solves keeps their span to
  # ~1e-3 (see dion_jax.kernels.rcqr_xla.xla_solve); a well-spread spectrum to float32 rounding.
  assert _span_residual(Q_cqr, P_mxr) < (1e-5 if P_kind == "ill_conditioned" else 2e-3)


def test_batched_cqr_decides_once_for_the_batch():
  good = [_with_condition(10.0, seed=s)[0] for s in range(3)]
  bad, _ = _with_condition(1e6, seed=3)
  assert _cholesky_fails(bad) and not any(_cholesky_fails(p) for p in good)
  batch = lambda Ps, **kw: qr.cholesky_qr_batch(jnp.stack(Ps), 11, backend="xla", **kw)
  # All Cholesky factorizations succeed: each matrix gets Cholesky QR.
  np.testing.assert_allclose(batch(good), jnp.stack([_ortho(p, "cqr") for p in good]), atol=1e-6)
  # One fails: the whole batch gets RCQR, which spans the same columns.
  rcqr_batch = jax.vmap(lambda P: _ortho(P, "rcqr"))
  mixed = good + [bad]
  got, want = batch(mixed), rcqr_batch(jnp.stack(mixed))
  np.testing.assert_allclose(got[:3], want[:3], atol=SAME_Q_WELL_CONDITIONED)
  np.testing.assert_allclose(got[3], want[3], atol=SAME_Q_ILL_CONDITIONED)
  np.testing.assert_allclose(batch(good, use_cqr=False), rcqr_batch(jnp.stack(good)), atol=SAME_Q_WELL_CONDITIONED)
  # One conditional for the batch, not a select between two computed branches.
  jaxpr = jax.make_jaxpr(lambda P: qr.cholesky_qr_batch(P, 11, backend="xla"))(jnp.stack(good))
  assert [e.primitive.name for e in jaxpr.eqns].count("cond") == 1
  assert "select_n" not in {e.primitive.name for e in jaxpr.eqns}


def test_cqr_during_warmup_is_rcqr():
  P_mxr, _ = _with_condition(1.0)
  np.testing.assert_allclose(_ortho(P_mxr, "cqr", use_cqr=False), _ortho(P_mxr, "rcqr"), atol=SAME_Q_WELL_CONDITIONED)
  # use_cqr may be traced (Dion passes count > warmup): one compiled function, both branches.
  f = jax.jit(lambda p, flag: _ortho(p, "cqr", use_cqr=flag))
  np.testing.assert_allclose(f(P_mxr, False), _ortho(P_mxr, "rcqr"), atol=SAME_Q_WELL_CONDITIONED)
  np.testing.assert_allclose(f(P_mxr, True), _ortho(P_mxr, "cqr", use_cqr=True), atol=1e-6)


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


@pytest.mark.parametrize("method", ["qr", "cqr", "rcqr"])
def test_row_sharded_equals_unsharded(method):
  """Rows split over a 4-way "tp" axis give the rows of the one-device result."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
  P_mxr, _ = _with_condition(10.0, m=256, r=32)

  def local(p):
    return qr.orthonormalize(p, method=method, seed=5, axis_name="tp", backend="xla")

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("tp", None), out_specs=P("tp", None)))
  Q_sharded = sharded(P_mxr)
  Q_single = qr.orthonormalize(P_mxr, method=method, seed=5, backend="xla")
  np.testing.assert_allclose(Q_sharded, Q_single, atol=2e-5)


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
