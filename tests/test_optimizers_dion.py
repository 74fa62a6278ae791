"""Dion's matrix step against the PyTorch reference's trajectories and float64 NumPy."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion_jax
from dion_jax.optimizers import dion_math
from tests import dion_reference_np

# microsoft/dion's reference trajectories (tests/fixtures/golden/README.md).
GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "golden" / "dion_reference.npz"


def _golden():
  data = np.load(GOLDEN)
  return data, json.loads(str(data["meta_json"]))


def _only_dion(params):
  return jax.tree.map(lambda _: "dion", params)


def _set_q(state, q_tree):
  return optax.tree.set(state, q=q_tree)


def run_dion(X0_mxn, Q0, grads_txmxn, *, backend="xla", **kwargs):
  """Runs dion_jax.dion() on the Flax-layout kernel X0ᵀ; returns X (T, m, n) and M (T, m, n)."""
  tx = dion_jax.dion(labels=_only_dion, backend=backend, **kwargs)
  params = {"w": jnp.asarray(X0_mxn.T, jnp.float32)}
  state = _set_q(tx.init(params), {"w": jnp.asarray(Q0, jnp.float32)})

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update({"w": g}, state, params)
    return optax.apply_updates(params, updates), state

  xs, ms = [], []
  for G in grads_txmxn:
    params, state = step(params, state, jnp.asarray(G.T, jnp.float32))
    xs.append(np.asarray(params["w"]).T)
    (m,) = optax.tree.get_all_with_path(state, "momentum")[0][1].values()
    ms.append(np.asarray(m).T)
  return np.stack(xs), np.stack(ms)


def _golden_cases():
  return sorted(_golden()[1])


# ‖X − X_ref‖ per step relative to the reference's step size, about 10x what is reached
# (measured, both backends: at most 2.8e-5; Householder QR of the full-rank square case
# 6.8e-4, float32 QR of a full-rank P); momentum relative to its norm: at most 1.9e-7.
X_STEP_TOLERANCE = {"square_full_qr": 7e-3}
X_STEP_TOLERANCE_DEFAULT = 3e-4
M_TOLERANCE = 2e-6


@pytest.mark.parametrize("backend, qr_method", [("xla", "reference's"), ("pallas", "reference's"), ("xla", "shifted_cqr"),
                                                ("pallas", "shifted_cqr")])  # the GPU default's kernel, interpreted
@pytest.mark.parametrize("case", _golden_cases())
def test_reproduces_reference_trajectories(case, backend, qr_method):
  """The case's own orthonormalization, and the default one (any QR's Q gives the same step)."""
  data, meta = _golden()
  cfg = meta[case]
  X_ref, M_ref = data[f"{case}/X"], data[f"{case}/M"]
  X, M = run_dion(
      data[f"{case}/X0"], data[f"{case}/Q0"], data[f"{case}/G"], backend=backend,
      learning_rate=cfg["lr"], mu=cfg["mu"], weight_decay=cfg["weight_decay"],
      epsilon=cfg["epsilon"], rank_fraction=cfg["rank_fraction"],
      rank_multiple_of=cfg.get("rank_multiple_of", 1),
      qr_method=cfg["qr_method"] if qr_method == "reference's" else qr_method,
  )  # fmt: skip
  X_prev = np.concatenate([data[f"{case}/X0"][None], X_ref[:-1]])
  for t in range(cfg["steps"]):
    step_size = np.linalg.norm(X_ref[t] - X_prev[t])
    x_tolerance = X_STEP_TOLERANCE.get(case, X_STEP_TOLERANCE_DEFAULT)
    assert np.linalg.norm(X[t] - X_ref[t]) <= x_tolerance * step_size, (case, t)
    assert np.linalg.norm(M[t] - M_ref[t]) <= M_TOLERANCE * np.linalg.norm(M_ref[t]), (case, t)


def test_golden_file_has_cases():
  assert len(_golden_cases()) >= 4


SHAPES = {
    "tall": (96, 40),  # (fan_out, fan_in)
    "wide": (24, 72),
    "square": (48, 48),
}


@pytest.mark.parametrize("qr_method", ["qr", "cqr", "rcqr"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_float64_numpy(shape, qr_method, weight_decay):
  m, n = SHAPES[shape]
  # hash() of a str differs per process (PYTHONHASHSEED): seed from the parameters' positions.
  rng = np.random.default_rng(sorted(SHAPES).index(shape) * 3 + ["qr", "cqr", "rcqr"].index(qr_method))
  r = dion_reference_np.rank_of(m, n, 0.5)
  X0 = rng.normal(size=(m, n))
  Q0 = rng.normal(size=(n if m >= n else m, r))
  grads = rng.normal(size=(5, m, n))
  X, M = run_dion(
      X0, Q0, grads, learning_rate=0.02, mu=0.9, weight_decay=weight_decay,
      rank_fraction=0.5, qr_method=qr_method, cqr_warmup_steps=2,
  )  # fmt: skip
  ref = dion_reference_np.dion_steps(X0, Q0, grads, lr=0.02, mu=0.9, weight_decay=weight_decay)
  X_prev = X0
  for t, (X_t, M_t, _) in enumerate(ref):
    assert np.linalg.norm(X[t] - X_t) <= 2e-3 * np.linalg.norm(X_t - X_prev), (t,)
    assert np.linalg.norm(M[t] - M_t) <= 1e-4 * np.linalg.norm(M_t), (t,)
    X_prev = X_t


def test_stacked_matrices_are_independent():
  """A (3, fan_in, fan_out) parameter equals three separate matrices."""
  rng = np.random.default_rng(1)
  L, fan_in, fan_out, r = 3, 32, 48, 8
  X0 = rng.normal(size=(L, fan_in, fan_out)).astype(np.float32)
  grads = rng.normal(size=(4, L, fan_in, fan_out)).astype(np.float32)
  tx = dion_jax.dion(0.05, rank_fraction=r / fan_in, labels=_only_dion, backend="xla")
  state = tx.init({"w": X0})
  (Q0,) = optax.tree.get_all_with_path(state, "q")[0][1].values()
  assert Q0.shape == (L, fan_in, r)
  params = {"w": jnp.asarray(X0)}
  for g in grads:
    upd, state = tx.update({"w": jnp.asarray(g)}, state, params)
    params = optax.apply_updates(params, upd)
  for layer in range(L):
    ref = dion_reference_np.dion_steps(
        X0[layer].T, np.asarray(Q0[layer]), grads[:, layer].transpose(0, 2, 1),
        lr=0.05, mu=0.95, weight_decay=0.01,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(params["w"][layer]).T, ref[-1][0], rtol=0, atol=2e-4)


@pytest.mark.parametrize("qr_method", ["rcqr", "cqr"])
@pytest.mark.parametrize("shape", [(3, 24, 40), (3, 40, 24)], ids=["rows_last", "rows_first"])
def test_matrix_by_matrix_and_batched_steps_agree(shape, qr_method, monkeypatch):
  """The CPU's in-place scan over a stack and the batched step (GPU, sharded) are the same
  algebra; a zero matrix in the stack exercises the per-matrix guard."""
  rng = np.random.default_rng(2)
  grads = rng.normal(size=(3,) + shape).astype(np.float32)
  grads[:, 1] = 0.0
  params = {"w": jnp.asarray(rng.normal(size=shape).astype(np.float32))}

  def run():
    tx = dion_jax.scale_by_dion(rank_fraction=0.5, qr_method=qr_method, cqr_warmup_steps=1, backend="xla")
    state, outs = tx.init(params), []
    for g in grads:
      upd, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state, params)
      outs.append(upd["w"])
    return np.stack(outs), state

  scanned, scanned_state = run()
  monkeypatch.setattr(dion_math, "_matrix_by_matrix", lambda axes, batch: False)
  batched, batched_state = run()
  np.testing.assert_allclose(scanned, batched, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(scanned[:, 1], 0)
  np.testing.assert_allclose(scanned_state.momentum["w"], batched_state.momentum["w"], rtol=1e-5, atol=1e-6)
  # Q's column signs may differ between orthonormalizations (the update does not see signs).
  np.testing.assert_allclose(np.abs(scanned_state.q["w"]), np.abs(batched_state.q["w"]), rtol=1e-5, atol=1e-6)


def test_zero_gradient_leaves_state_alone():
  tx = dion_jax.scale_by_dion(rank_fraction=0.5, backend="xla")
  params = {"w": jnp.ones((16, 8))}
  state = tx.init(params)
  upd, new = tx.update({"w": jnp.zeros((16, 8))}, state, params)
  np.testing.assert_array_equal(upd["w"], 0)
  q0 = np.asarray(state.q["w"])
  np.testing.assert_allclose(new.q["w"], q0 / (np.linalg.norm(q0, axis=0) + 1e-8), rtol=1e-6)
  np.testing.assert_array_equal(new.momentum["w"], 0)


def test_a_failed_factorization_keeps_q_and_the_matrix_learns_next_step():
  """RCQR at full rank fails (NaN) on a rank-one momentum. The reference's guard turns the
  NaN into 0, which zeroes Q for good (every later update 0); here that matrix keeps its Q
  and skips one step, and its next step is float64 NumPy's from the state it kept. The
  other matrix of the batch steps as usual."""
  rows, cols, mu = 16, 8, 0.95
  rng = np.random.default_rng(7)
  G0 = rng.normal(size=(2, rows, cols))
  G0[0] = 0.0
  G0[0, :, 0] = 1.0  # rank one, r = cols
  G1 = rng.normal(size=(2, rows, cols))
  Q0 = rng.normal(size=(2, cols, cols))
  hp = dion_math.DionHyperParams(mu=mu, qr_method="rcqr", backend="xla")
  step = jax.jit(dion_math.dion_matrix_step, static_argnames=("scale", "hp"))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  M, Q, U = step(f32(np.zeros_like(G0)), f32(G0), f32(Q0), jnp.uint32(1), jnp.asarray(False), scale=1.0, hp=hp)
  # Exact by construction, not a rounding comparison: the guard selects P = 0, so the update is
  # 0 · Q and the error feedback subtracts 0 from B = 0 + G.
  np.testing.assert_array_equal(U[0], 0)
  np.testing.assert_allclose(Q[0], Q0[0] / (np.linalg.norm(Q0[0], axis=0) + 1e-8), rtol=1e-6)
  np.testing.assert_array_equal(M[0], f32(G0[0]))
  assert np.abs(U[1]).max() > 0.1
  _, _, U = step(M, f32(G1), Q, jnp.uint32(2), jnp.asarray(False), scale=1.0, hp=hp)
  B = G0[0] + G1[0]
  P = np.linalg.qr(B @ (Q0[0] / np.linalg.norm(Q0[0], axis=0)))[0]
  R = B.T @ P
  U_ref = P @ (R / np.linalg.norm(R, axis=0)).T
  # Achieved 3.9e-7 of the update's size: float32 RCQR of a full-rank 16 x 8 P.
  assert np.linalg.norm(U[0] - U_ref) <= 2e-6 * np.linalg.norm(U_ref)


def test_momentum_and_q_dtypes():
  tx = dion_jax.scale_by_dion(momentum_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, backend="xla")
  params = {"w": jnp.ones((16, 8), jnp.float32)}
  state = tx.init(params)
  assert state.momentum["w"].dtype == jnp.bfloat16 and state.q["w"].dtype == jnp.bfloat16
  upd, state = tx.update({"w": jnp.ones((16, 8)) * 0.1}, state, params)
  assert upd["w"].dtype == jnp.float32
  assert state.momentum["w"].dtype == jnp.bfloat16 and state.q["w"].dtype == jnp.bfloat16


def test_mixed_precision_keeps_bfloat16_state_close_to_float32():
  """microsoft/dion's mixed_precision: bfloat16 M and Q; three steps stay within bfloat16
  rounding of the float32-state updates (achieved 6e-3 relative)."""
  rng = np.random.default_rng(5)
  params = {"w": jnp.asarray(rng.normal(size=(24, 40)), jnp.float32)}
  grads = [jnp.asarray(rng.normal(size=(24, 40)), jnp.float32) for _ in range(3)]

  def run(**kw):
    tx = dion_jax.dion(0.02, rank_fraction=0.5, labels=_only_dion, backend="xla", **kw)
    state, upds = tx.init(params), []
    for g in grads:
      upd, state = jax.jit(tx.update)({"w": g}, state, params)
      upds.append(np.asarray(upd["w"]))
    return np.stack(upds), state

  mixed, state = run(mixed_precision=True)
  full, _ = run()
  (M,) = optax.tree.get_all_with_path(state, "momentum")[0][1].values()
  (Q,) = optax.tree.get_all_with_path(state, "q")[0][1].values()
  assert M.dtype == jnp.bfloat16 and Q.dtype == jnp.bfloat16 and mixed.dtype == np.float32
  assert np.linalg.norm(mixed - full) <= 3e-2 * np.linalg.norm(full)
  explicit, state = run(mixed_precision=True, momentum_dtype=jnp.float32)
  (M,) = optax.tree.get_all_with_path(state, "momentum")[0][1].values()
  assert M.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(rank_fraction=0.0), "rank_fraction"),
        (dict(rank_fraction=1.5), "rank_fraction"),
        (dict(mu=-0.1), "mu"),
        (dict(qr_method="svd"), "qr_method"),
        (dict(power_iters=0), "power_iters"),
        (dict(scale_rule="bogus"), "scale_rule"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_hyperparameters(kwargs, word):
  with pytest.raises(ValueError, match=word):
    dion_jax.scale_by_dion(**kwargs)


def test_vector_labelled_dion_is_an_error():
  tx = dion_jax.scale_by_dion()
  with pytest.raises(ValueError, match=r"\['b'\].*shape \(8,\)"):
    tx.init({"b": jnp.ones(8)})


def _momentum_with_spectrum(sigma, rows=96, cols=48, seed=3):
  rng = np.random.default_rng(seed)
  U = np.linalg.qr(rng.normal(size=(rows, cols)))[0]
  V = np.linalg.qr(rng.normal(size=(cols, cols)))[0]
  return (U * sigma) @ V.T, U


@pytest.mark.parametrize("qr_method", ["shifted_cqr", "qr"])
@pytest.mark.parametrize("spectrum", ["cond10", "cond1e12_half_rank"])
def test_step_on_ill_conditioned_momentum_matches_float64_householder(spectrum, qr_method):
  """One step from a momentum of condition 10, or of condition 1e12 whose B Q has rank r/2:
  the new momentum everywhere, and the update in the directions B Q determines (the span
  of its top r/2 left singular vectors: Householder's other columns are arbitrary), against
  a float64 NumPy step with Householder QR."""
  rows, cols, r, k = 96, 48, 24, 12
  if spectrum == "cond10":
    sigma = np.logspace(0, -1, cols)
  else:
    sigma = np.concatenate([np.logspace(0, -2, k), 1e-12 * np.logspace(0, -0.5, cols - k)])
  B, U_left = _momentum_with_spectrum(sigma, rows, cols)
  Q0 = np.random.default_rng(4).normal(size=(cols, r))
  hp = dion_math.DionHyperParams(mu=0.9, qr_method=qr_method, backend="xla")
  M, Q, U = jax.jit(dion_math.dion_matrix_step, static_argnames=("scale", "hp"))(
      jnp.zeros((1, rows, cols), jnp.float32), jnp.asarray(B[None], jnp.float32), jnp.asarray(Q0[None], jnp.float32),
      jnp.uint32(1), jnp.asarray(False), scale=1.0, hp=hp)
  P_ref = np.linalg.qr(B @ Q0)[0]
  R_ref = B.T @ P_ref
  M_ref = B - 0.1 * P_ref @ R_ref.T
  U_ref = P_ref @ (R_ref / (np.linalg.norm(R_ref, axis=0) + 1e-8)).T
  # Achieved (shifted_cqr; qr): momentum 8e-8; 6e-8 relative; update 5e-7; 4e-7 (cond 10), 1.5e-4;
  # 6e-5 (cond 1e12: the fill, 2e-7 of P, over the pivots of B Q's weakest determined columns).
  assert np.linalg.norm(M[0] - M_ref) <= 1e-6 * np.linalg.norm(M_ref)
  project = np.eye(rows) if spectrum == "cond10" else U_left[:, :k] @ U_left[:, :k].T
  tol = 5e-6 if spectrum == "cond10" else 1e-3
  assert np.linalg.norm(project @ (U[0] - U_ref)) <= tol * np.linalg.norm(project @ U_ref)


@pytest.mark.parametrize("power_precision,qr_precision,low,high", [
    (None, "float32", 0.0, 1e-6), ("float32", "float32", 0.0, 1e-6), ("tensorfloat32", "float32", 1e-4, 1.5e-3),
    ("bfloat16", "float32", 1e-3, 1e-2), ("float32", "tensorfloat32x3", 0.0, 1e-6)])
def test_product_precisions_against_float64(power_precision, qr_precision, low, high):
  """One step against float64 NumPy with Householder QR: the update is off by what the
  inputs of B Q and Bᵀ P lose (reached: 4.1e-7 in float32, 4.0e-4 with TF32's 11
  significant bits, 3.0e-3 with bfloat16's 8), the state stays float32. The Cholesky QR
  passes' Grams and products as three TF32 products (emulated here) cost nothing
  measurable (reached 4.2e-7; one TF32 product per matmul left 4.2e-4)."""
  rows, cols, r = 96, 48, 24
  rng = np.random.default_rng(5)
  B, Q0 = rng.normal(size=(rows, cols)), rng.normal(size=(cols, r))
  P_ref = np.linalg.qr(B @ Q0)[0]
  R_ref = B.T @ P_ref
  U_ref = P_ref @ (R_ref / (np.linalg.norm(R_ref, axis=0) + 1e-8)).T
  hp = dion_math.DionHyperParams(mu=0.9, qr_method="shifted_cqr", backend="xla", power_precision=power_precision,
                                 qr_precision=qr_precision)
  M, Q, U = jax.jit(dion_math.dion_matrix_step, static_argnames=("scale", "hp"))(
      jnp.zeros((1, rows, cols), jnp.float32), jnp.asarray(B[None], jnp.float32), jnp.asarray(Q0[None], jnp.float32),
      jnp.uint32(1), jnp.asarray(False), scale=1.0, hp=hp)
  assert M.dtype == Q.dtype == U.dtype == jnp.float32
  assert low <= np.linalg.norm(U[0] - U_ref) / np.linalg.norm(U_ref) < high


def test_unknown_power_or_qr_precision():
  with pytest.raises(ValueError, match="power_precision"):
    dion_jax.scale_by_dion(power_precision="float16")
  with pytest.raises(ValueError, match="qr_precision='tensorfloat32' is not supported"):
    dion_jax.scale_by_dion(qr_precision="tensorfloat32")


@pytest.mark.parametrize("power_precision,marker", [("tensorfloat32", "lhs_precision_type = tf32"),
                                                    ("bfloat16", "xbf16>) ->")])
def test_power_precision_as_on_a_gpu(monkeypatch, power_precision, marker):
  """Traced as on a GPU: B Q and Bᵀ P (and only they) run TF32's dot algorithm, or take
  bfloat16 operands; no emulated rounding."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  hp = dion_math.DionHyperParams(qr_method="shifted_cqr", backend="xla", power_precision=power_precision)
  f = functools.partial(dion_math.dion_matrix_step, scale=1.0, hp=hp)
  args = (jnp.zeros((1, 96, 48)), jnp.zeros((1, 96, 48)), jnp.zeros((1, 48, 24)), jnp.uint32(1), jnp.asarray(False))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  of_b = [line for line in dots if "1x96x48x" in line.split("->")[0]]  # B is an operand: B Q, Pᵀ B
  assert len(of_b) == 2 and all(marker in line for line in of_b), dots
  assert not any(marker in line for line in dots if line not in of_b), dots
  assert "bitcast_convert" not in text  # the emulated rounding is for CPUs
