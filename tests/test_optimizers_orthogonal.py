"""dion_jax.muon / normuon / dion2 against the reference's trajectories and an
independent float64 NumPy implementation (tests/family_reference_np.py)."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dion_jax
from dion_jax.linalg import polar_factor
from dion_jax.optimizers import scale_rule_fn
from tests import family_reference_np as ref

# microsoft/dion's reference trajectories (tests/fixtures/golden/README.md).
GOLDEN = pathlib.Path(__file__).parent / "fixtures" / "golden" / "family_reference.npz"


def _run(tx, X0_kernel, grads_kernel, fields=("momentum",)):
  """X (Flax layout) and the state ``fields`` after each step of ``tx`` on one matrix ``w``."""
  params = {"w": jnp.asarray(X0_kernel, jnp.float32)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update({"w": g}, state, params)
    return optax.apply_updates(params, updates), state

  out = []
  for g in grads_kernel:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
    out.append((np.asarray(params["w"], np.float64), *(np.asarray(optax.tree.get(state, f)["w"]) for f in fields)))
  return out


def _assert_steps(got, want, X0, rel=2e-4, what="X"):
  """Per step t: ‖X − X_ref(t)‖ ≤ rel·‖X_ref(t) − X_ref(t−1)‖.

  The default is ~10x what float32 orthogonalization reaches against the float64
  references and the goldens (measured: at most 2.0e-5, Dion2 on the golden's tall case)."""
  prev = np.asarray(X0, np.float64)
  for t, (g, w) in enumerate(zip(got, want)):
    size = np.linalg.norm(w - prev)
    assert size > 0
    err = np.linalg.norm(g - w)
    assert err <= rel * size, f"{what} step {t}: error {err:.3g} vs step size {size:.3g}"
    prev = w


def _optimizer(meta, **options):
  common = dict(learning_rate=meta["lr"], weight_decay=meta["weight_decay"], ortho_dtype=jnp.float32,
                labels={"w": "dion"}, **options)  # fmt: skip
  if meta["algorithm"] == "dion2":
    return dion_jax.dion2(fraction=meta["fraction"], ef_decay=meta["ef_decay"], **common)
  if meta["algorithm"] == "normuon":
    return dion_jax.normuon(mu=meta["mu"], muon_beta2=meta["muon_beta2"], **common)
  return dion_jax.muon(mu=meta["mu"], **common)


@pytest.mark.parametrize("case", ["dion2_tall_f025", "dion2_wide_f05", "normuon_tall", "muon_wide"])
def test_replays_reference_trajectories(case):
  data = np.load(GOLDEN)
  meta = json.loads(str(data["meta_json"]))[case]
  X0, G, X, M = (data[f"{case}/{k}"] for k in ("X0", "G", "X", "M"))
  got = _run(_optimizer(meta), X0.T, [g.T for g in G])
  _assert_steps([x.T for x, _ in got], list(X), X0)
  for t, (_, m) in enumerate(got):
    np.testing.assert_allclose(m.T, M[t], rtol=1e-5, atol=1e-5 * np.abs(M[t]).max(), err_msg=f"M step {t}")


# The Gram steps (they run here: each case's orthogonalized matrix is at least twice as
# long as it is short) replay the five-step Polar Express trajectories as closely as
# the standard steps (achieved: X within 2.3e-5 of a step's size after six steps); the
# rescaled four steps orthogonalize diag(d)·M instead of M: X is 0.11-0.12 of a step away
# after the first step, 0.27-0.31 after the sixth (0.31 on muon_wide; 0.27 and 0.28 on
# the Dion2 cases).
@pytest.mark.parametrize("case, options, rel", [
    ("dion2_tall_f025", dict(gram_newton_schulz=True), 2e-4),
    ("dion2_wide_f05", dict(gram_newton_schulz=True), 2e-4),
    ("muon_wide", dict(gram_newton_schulz=True), 2e-4),
    ("muon_wide", dict(ortho_method="rescaled_newton_schulz"), 0.4),
])  # fmt: skip
def test_options_replay_reference_trajectories(case, options, rel):
  data = np.load(GOLDEN)
  meta = json.loads(str(data["meta_json"]))[case]
  X0, G, X = (data[f"{case}/{k}"] for k in ("X0", "G", "X"))
  got = _run(_optimizer(meta, **options), X0.T, [g.T for g in G])
  _assert_steps([x.T for x, _ in got], list(X), X0, rel=rel)


SHAPES = {"tall": (48, 24), "wide": (24, 40), "square": (32, 32)}


def _grads(shape, steps=4, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=shape) for _ in range(steps)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("algorithm", ["muon_nesterov_cautious", "normuon", "dion2"])
def test_matches_float64_numpy(algorithm, shape):
  m, n = SHAPES[shape]  # (fan_out, fan_in)
  X0 = np.random.default_rng(1).normal(size=(m, n)) * 0.1
  grads = _grads((m, n))
  kw = dict(learning_rate=0.02, weight_decay=0.1, ortho_dtype=jnp.float32, labels={"w": "dion"})
  if algorithm == "dion2":
    tx, want = dion_jax.dion2(fraction=0.3, **kw), ref.dion2_steps(X0, grads, 0.02, fraction=0.3, wd=0.1)
  elif algorithm == "normuon":
    tx, want = dion_jax.normuon(**kw), ref.muon_steps(X0, grads, 0.02, wd=0.1, normuon=True)
  else:
    tx = dion_jax.muon(nesterov=True, cautious_wd=True, **kw)
    want = ref.muon_steps(X0, grads, 0.02, wd=0.1, nesterov=True, cautious=True)
  got = _run(tx, X0.T, [g.T for g in grads])
  _assert_steps([x.T for x, _ in got], [x for x, _ in want], X0)


@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion2"])
def test_stacked_matrices_are_independent(algorithm):
  """A (layers, fan_in, fan_out) kernel and a (fan_out, fan_in, layers) one with its
  dimension numbers: each slice follows the float64 reference of its own matrix."""
  layers, fan_in, fan_out = 3, 24, 40
  rng = np.random.default_rng(2)
  X0 = rng.normal(size=(layers, fan_out, fan_in)) * 0.1
  grads = [rng.normal(size=(layers, fan_out, fan_in)) for _ in range(3)]
  kw = dict(learning_rate=0.02, weight_decay=0.05, ortho_dtype=jnp.float32, labels={"w": "dion"})
  make = {"muon": dion_jax.muon, "normuon": dion_jax.normuon, "dion2": dion_jax.dion2}[algorithm]
  for layout, dims in [((0, 2, 1), None), ((1, 2, 0), dion_jax.DionDimensionNumbers(1, 0))]:
    tx = make(dimension_numbers=dims, **kw)
    got = _run(tx, X0.transpose(layout), [g.transpose(layout) for g in grads])
    inv = np.argsort(layout)
    for i in range(layers):
      if algorithm == "dion2":
        want = ref.dion2_steps(X0[i], [g[i] for g in grads], 0.02, wd=0.05)
      else:
        want = ref.muon_steps(X0[i], [g[i] for g in grads], 0.02, wd=0.05, normuon=algorithm == "normuon")
      _assert_steps([x.transpose(inv)[i] for x, _ in got], [x for x, _ in want], X0[i])


def test_num_heads_orthogonalizes_each_head():
  heads, head_dim, fan_in = 4, 8, 24
  rng = np.random.default_rng(3)
  X0 = rng.normal(size=(heads * head_dim, fan_in)) * 0.1
  grads = [rng.normal(size=X0.shape) for _ in range(3)]
  tx = dion_jax.normuon(0.02, num_heads=heads, ortho_dtype=jnp.float32, weight_decay=0.0, labels={"w": "dion"})
  got = _run(tx, X0.T, [g.T for g in grads])
  for h in range(heads):
    rows = slice(h * head_dim, (h + 1) * head_dim)
    want = ref.muon_steps(X0[rows], [g[rows] for g in grads], 0.02, normuon=True)
    _assert_steps([x.T[rows] for x, _ in got], [x for x, _ in want], X0[rows])


def test_bf16_default_is_close_to_float32():
  """The default bf16 orthogonalization moves each step by 14% of its size (measured; the
  reference's bf16 moves it by 10-20%), never by its whole size."""
  X0, grads = np.zeros((32, 48)), _grads((32, 48), steps=2)
  want = ref.muon_steps(X0, grads, 0.01)
  got = _run(dion_jax.muon(0.01, weight_decay=0.0, labels={"w": "dion"}), X0.T, [g.T for g in grads])
  _assert_steps([x.T for x, _ in got], [x for x, _ in want], X0, rel=0.2)


def test_newton_schulz_option():
  G = np.random.default_rng(4).normal(size=(24, 40))
  got = polar_factor(jnp.asarray(G, jnp.float32), method="newton_schulz", dtype=jnp.float32)
  want = ref.polar(G, ref.NEWTON_SCHULZ, safety=1.0)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


def test_routing_schedules_inject_hyperparams_and_multisteps():
  """Scalars go to AdamW like dion's; a schedule and inject_hyperparams give the same
  first step as the constant; MultiSteps accumulates before updating."""
  params = {"w": jnp.ones((24, 40)) * 0.1, "b": jnp.zeros((40,))}
  grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(5).normal(size=p.shape), jnp.float32), params)
  tx = dion_jax.dion2(0.02, ortho_dtype=jnp.float32)
  updates, _ = tx.update(grads, tx.init(params), params)
  adam = optax.adamw(0.02, b1=0.9, b2=0.95, weight_decay=0.01)
  want_b, _ = adam.update({"b": grads["b"]}, adam.init({"b": params["b"]}), {"b": params["b"]})
  np.testing.assert_allclose(updates["b"], want_b["b"], rtol=1e-6)
  sched = dion_jax.dion2(optax.constant_schedule(0.02), ortho_dtype=jnp.float32)
  np.testing.assert_allclose(sched.update(grads, sched.init(params), params)[0]["w"], updates["w"], rtol=1e-6)
  inj = optax.inject_hyperparams(dion_jax.dion2, static_args=dion_jax.DION2_STATIC_ARGS)(
      learning_rate=0.02, ortho_dtype=jnp.float32
  )
  np.testing.assert_allclose(inj.update(grads, inj.init(params), params)[0]["w"], updates["w"], rtol=1e-6)
  multi = optax.MultiSteps(dion_jax.muon(0.02), every_k_schedule=2)
  state = multi.init(params)
  first, state = multi.update(grads, state, params)
  assert not np.any(np.asarray(first["w"]))
  second, _ = multi.update(grads, state, params)
  assert np.abs(np.asarray(second["w"])).max() > 0


@pytest.mark.parametrize(
    "make, kwargs, option",
    [
        (dion_jax.dion2, dict(fraction=0.0), "fraction"),
        (dion_jax.dion2, dict(selection_scope="row"), "selection_scope"),
        (dion_jax.normuon, dict(muon_beta2=1.5), "muon_beta2"),
        (dion_jax.muon, dict(ortho_method="svd"), "ortho_method"),
        (dion_jax.muon, dict(ortho_dtype=jnp.float16), "ortho_dtype"),
        (dion_jax.muon, dict(scale_rule="spectral_nrom"), "scale_rule"),
        (dion_jax.muon, dict(mu=-0.1), "mu"),
        (dion_jax.dion2, dict(ef_decay=-1.0), "ef_decay"),
    ],
)
def test_bad_hyperparameters_name_the_option(make, kwargs, option):
  with pytest.raises(ValueError, match=option):
    make(0.01, **kwargs)


def test_num_heads_must_divide_fan_out():
  with pytest.raises(ValueError, match="num_heads=5"):
    dion_jax.muon(0.01, num_heads=5, labels={"w": "dion"}).init({"w": jnp.zeros((8, 24))})
  with pytest.raises(ValueError, match="num_heads"):
    dion_jax.scale_by_orthogonal("dion2", num_heads=4)


def test_scale_rule_aliases():
  rule = scale_rule_fn
  assert rule("spectral_norm")(40, 10) == pytest.approx(2.0)
  assert rule("rms_norm")(40, 10) == pytest.approx(0.2 * math.sqrt(40))
  assert rule(None)(40, 10) == 1.0


class _Tiny(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.fc = nnx.Linear(8, 12, rngs=rngs)
    self.lm_head = nnx.Linear(12, 16, rngs=rngs)

  def __call__(self, tokens):
    return self.lm_head(jax.nn.relu(self.fc(self.embed(tokens))))


def test_nnx_optimizer_with_lion_and_lm_head_scale():
  """nnx.Optimizer runs NorMuon: its matrix follows the float64 reference on the
  gradients it was fed; the LM head gets Lion at lr/sqrt(d_model), as with dion."""
  lr, steps = 0.02, 2
  model = _Tiny(nnx.Rngs(0))
  p0 = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tx = dion_jax.normuon(lr, weight_decay=0.0, ortho_dtype=jnp.float32, scalar_optimizer="lion")
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss(model, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()

  @nnx.jit
  def train_step(model, opt, tokens):
    grads = nnx.grad(loss)(model, tokens)
    opt.update(model, grads)
    return nnx.to_pure_dict(grads)

  tokens = jax.random.randint(jax.random.key(1), (steps, 4, 6), 0, 16)
  grads = [train_step(model, opt, tokens[t]) for t in range(steps)]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  want = ref.muon_steps(np.asarray(p0["fc"]["kernel"]).T, [np.asarray(g["fc"]["kernel"]).T for g in grads], lr,
                        normuon=True)  # fmt: skip
  _assert_steps([np.asarray(params["fc"]["kernel"]).T], [want[-1][0]], want[-2][0])
  lion = optax.lion(lr / math.sqrt(12), b1=0.9, b2=0.95, weight_decay=0.0)
  head, state = p0["lm_head"]["kernel"], lion.init(p0["lm_head"]["kernel"])
  for g in grads:
    u, state = lion.update(g["lm_head"]["kernel"], state, head)
    head = optax.apply_updates(head, u)
  np.testing.assert_allclose(params["lm_head"]["kernel"], head, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [dion_jax.muon, dion_jax.normuon, dion_jax.dion2, dion_jax.nordion2])
def test_step_has_no_conditional_or_loop(make):
  """No lax.cond/switch (an XLA:GPU conditional copies its predicate to the host) and no
  while loop over matrices, with every orthogonalization option, scalars routed to AdamW."""
  params = {"w": jnp.zeros((2, 24, 64)), "v": jnp.zeros((64, 24)), "b": jnp.zeros((64,))}
  for options in (dict(), dict(gram_newton_schulz=True, ortho_method="rescaled_newton_schulz")):
    tx = make(0.01, **options)
    text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
    assert "stablehlo.dot_general" in text
    for op in ("stablehlo.case", "stablehlo.if", "stablehlo.while"):
      assert op not in text, f"{op} with {options}"
