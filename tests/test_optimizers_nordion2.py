"""dion_jax.nordion2 (NorDion2, alias dion3) against microsoft/dion's trajectories, an
independent float64 NumPy NorDion2 (tests/family_reference_np.py) and one device."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion_jax
from tests import family_reference_np as ref
from tests.test_optimizers_orthogonal import _assert_steps, _grads
from tests.test_optimizers_orthogonal import _run as _run_fields

GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "golden" / "nordion2_reference.npz"


def _run(tx, X0_kernel, grads_kernel):
  """X, momentum and per-neuron variance (Flax layout) after each step on one matrix."""
  return _run_fields(tx, X0_kernel, grads_kernel, ("momentum", "variance"))


def _golden_cases():
  return sorted(json.loads(str(np.load(GOLDEN)["meta_json"])))


@pytest.mark.parametrize("case", _golden_cases())
def test_replays_reference_trajectories(case):
  """The reference's keyword names, float32 orthogonalization: X within 2e-4 of each
  step's size (measured: 1.3e-5), M and the per-neuron v to float32 rounding."""
  data = np.load(GOLDEN)
  meta = json.loads(str(data["meta_json"]))[case]
  X0, G, X, M, V = (data[f"{case}/{k}"] for k in ("X0", "G", "X", "M", "V"))
  tx = dion_jax.dion3(meta["lr"], fraction=meta["fraction"], mu=meta["mu"], muon_beta2=meta["muon_beta2"],
                      weight_decay=meta["weight_decay"], ortho_dtype=jnp.float32, labels={"w": "dion"})
  got = _run(tx, X0.T, [g.T for g in G])
  _assert_steps([x.T for x, _, _ in got], list(X), X0)
  for t, (_, m, v) in enumerate(got):
    np.testing.assert_allclose(m.T, M[t], rtol=1e-5, atol=1e-5 * np.abs(M[t]).max(), err_msg=f"M step {t}")
    np.testing.assert_allclose(v.T, V[t], rtol=2e-5, atol=1e-6 * np.abs(V[t]).max(), err_msg=f"V step {t}")
    unselected = np.setdiff1d(np.arange(M.shape[1]), data[f"{case}/rows"][t])
    before = got[t - 1][2].T[unselected] if t else 0
    np.testing.assert_array_equal(v.T[unselected], before, err_msg=f"V step {t}: unselected rows moved")


SHAPES = {"tall": (48, 24), "wide": (24, 40), "square": (32, 32)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_float64_numpy(shape):
  m, n = SHAPES[shape]  # (fan_out, fan_in): rows are neurons whatever the shape.
  X0 = np.random.default_rng(1).normal(size=(m, n)) * 0.1
  grads = _grads((m, n))
  tx = dion_jax.nordion2(0.02, fraction=0.3, mu=0.9, muon_beta2=0.8, weight_decay=0.1, ortho_dtype=jnp.float32,
                         labels={"w": "dion"})  # fmt: skip
  want = ref.nordion2_steps(X0, grads, 0.02, fraction=0.3, mu=0.9, beta2=0.8, wd=0.1)
  got = _run(tx, X0.T, [g.T for g in grads])
  _assert_steps([x.T for x, _, _ in got], [x for x, _, _ in want], X0)
  np.testing.assert_allclose(got[-1][2].T, want[-1][2], rtol=1e-4)


def test_stacked_matrices_and_heads():
  """A (layers, fan_in, fan_out) kernel: each slice follows its own reference; with
  num_heads each head's rows are selected and normalized on their own."""
  layers, fan_in, fan_out, heads = 3, 24, 32, 4
  rng = np.random.default_rng(2)
  X0 = rng.normal(size=(layers, fan_out, fan_in)) * 0.1
  grads = [rng.normal(size=X0.shape) for _ in range(3)]
  kw = dict(learning_rate=0.02, weight_decay=0.05, ortho_dtype=jnp.float32, labels={"w": "dion"})
  got = _run(dion_jax.nordion2(**kw), X0.transpose(0, 2, 1), [g.transpose(0, 2, 1) for g in grads])
  for i in range(layers):
    want = ref.nordion2_steps(X0[i], [g[i] for g in grads], 0.02, wd=0.05)
    _assert_steps([x.transpose(0, 2, 1)[i] for x, _, _ in got], [x for x, _, _ in want], X0[i])
  got = _run(dion_jax.nordion2(num_heads=heads, **kw), X0[0].T, [g[0].T for g in grads])
  d = fan_out // heads
  for h in range(heads):
    rows = slice(h * d, (h + 1) * d)
    want = ref.nordion2_steps(X0[0][rows], [g[0][rows] for g in grads], 0.02, wd=0.05)
    _assert_steps([x.T[rows] for x, _, _ in got], [x for x, _, _ in want], X0[0][rows])


def test_inject_hyperparams_and_bad_options():
  params = {"w": jnp.ones((24, 40)) * 0.1, "b": jnp.zeros((40,))}
  grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(5).normal(size=p.shape), jnp.float32), params)
  tx = dion_jax.nordion2(0.02, ortho_dtype=jnp.float32)
  want, _ = tx.update(grads, tx.init(params), params)
  inj = optax.inject_hyperparams(dion_jax.nordion2, static_args=dion_jax.NORDION2_STATIC_ARGS)(
      learning_rate=0.02, ortho_dtype=jnp.float32)
  # atol: an entry where the update nearly cancels the weight decay (3.8e-6 of updates up to
  # 7.7e-3) differs by 10 float32 ulps on jax 0.12, whose CPU programs round otherwise.
  np.testing.assert_allclose(inj.update(grads, inj.init(params), params)[0]["w"], want["w"], rtol=1e-6, atol=1e-9)
  for kwargs, option in [(dict(fraction=1.5), "fraction"), (dict(muon_beta2=-0.1), "muon_beta2"),
                         (dict(selection_scope="rows"), "selection_scope"), (dict(mu=float("nan")), "mu")]:
    with pytest.raises(ValueError, match=option):
      dion_jax.nordion2(0.01, **kwargs)
