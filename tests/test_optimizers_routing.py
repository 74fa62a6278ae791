"""dion_jax.dion inside the optax ecosystem: chains, schedules, inject_hyperparams,
MultiSteps, jit, Flax NNX, and the routing of parameters to Dion / AdamW / Lion / Muon.

Every test checks values against a reference computed independently: the float64
NumPy Dion of tests/dion_reference_np.py for the matrices, optax's own AdamW, Lion
and Muon run alone for the other parameters.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dion_jax
from tests import dion_reference_np

FAN_IN, FAN_OUT, RANK_FRACTION = 24, 40, 0.5
ADAMW = dict(b1=0.9, b2=0.95, eps=1e-8)  # dion's default scalar-optimizer settings


def _labels(**by_name):
  return lambda params: {k: by_name[k] for k in params}


def _dion_q(state, name="w"):
  """The Dion Q of parameter ``name`` from any state that holds a ScaleByDionState."""
  return np.asarray(optax.tree.get_all_with_path(state, "q")[0][1][name])


def _reference_directions(Q0, grads_kernel, mu=0.95):
  """``scale·P Qᵀ`` of each step, float64, in Flax kernel layout (fan_in, fan_out).

  The reference's update is linear in lr given the directions, so running it with
  lr = 1 and no weight decay from X = 0 exposes them as differences of X.
  """
  X0 = np.zeros(grads_kernel[0].T.shape)
  steps = dion_reference_np.dion_steps(
      X0, Q0, [np.asarray(g, np.float64).T for g in grads_kernel], lr=1.0, mu=mu, weight_decay=0.0
  )
  Xs = [X0] + [X for X, _, _ in steps]
  return [-(Xs[t + 1] - Xs[t]).T for t in range(len(steps))]


def _reference_trajectory(X0, directions, lrs, weight_decay):
  """``X ← (1 − lr·wd) X − lr·dir`` with lr = lrs[t] at step t; list of X after each step."""
  X, out = np.asarray(X0, np.float64), []
  for d, lr in zip(directions, lrs):
    X = (1 - lr * weight_decay) * X - lr * d
    out.append(X)
  return out


def _assert_trajectory(got, want, X0, rel=2e-3):
  """Per step, ‖X − X_ref‖ ≤ rel·‖X_ref(t) − X_ref(t−1)‖ (the size of the step)."""
  prev = np.asarray(X0, np.float64)
  for t, (x, ref) in enumerate(zip(got, want)):
    assert np.linalg.norm(np.asarray(x) - ref) <= rel * np.linalg.norm(ref - prev), t
    prev = ref


def _run_alone(tx, params, grads):
  """Runs ``tx`` on ``params`` over ``grads``; list of params after each step. Jitted: one
  compile, where eager dispatch compiles each of the update's many small operations."""
  @jax.jit
  def step(params, state, g):
    upd, state = tx.update(g, state, params)
    return optax.apply_updates(params, upd), state

  state, out = jax.jit(tx.init)(params), []
  for g in grads:
    params, state = step(params, state, g)
    out.append(params)
  return out


def _matrix_and_bias(seed=0, steps=4, grad_scale=1.0):
  rng = np.random.default_rng(seed)
  params = {
      "w": jnp.asarray(rng.normal(size=(FAN_IN, FAN_OUT)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(FAN_OUT,)), jnp.float32),
  }
  grads = [
      {k: jnp.asarray(grad_scale * rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
      for _ in range(steps)
  ]
  return params, grads


def _run(tx, params, grads, edit_state=None):
  """Runs ``tx`` jitted; returns the params after each step, Q0 of "w" and the trace count."""
  traces = []

  @jax.jit
  def step(params, state, g):
    traces.append(None)
    upd, state = tx.update(g, state, params)
    return optax.apply_updates(params, upd), state

  state = tx.init(params)
  q0, out = _dion_q(state), []
  for t, g in enumerate(grads):
    if edit_state is not None:
      state = edit_state(t, state)
    params, state = step(params, state, g)
    out.append(params)
  return out, q0, len(traces)


# --- Optax integration --------------------------------------------------------------


def test_inside_chain_after_clip_by_global_norm():
  params, grads = _matrix_and_bias(grad_scale=10.0)
  max_norm, lr, wd = 1.0, 0.05, 0.1
  tx = optax.chain(
      optax.clip_by_global_norm(max_norm),
      dion_jax.dion(lr, rank_fraction=RANK_FRACTION, weight_decay=wd, backend="xla"),
  )
  got, q0, _ = _run(tx, params, grads)

  def clip(g):
    norm = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in g.values()))
    assert norm > 5 * max_norm  # clipping is engaged
    return {k: np.asarray(v, np.float64) * max_norm / norm for k, v in g.items()}

  clipped = [clip(g) for g in grads]
  dirs = _reference_directions(q0, [g["w"] for g in clipped])
  want = _reference_trajectory(params["w"], dirs, [lr] * len(grads), wd)
  _assert_trajectory([p["w"] for p in got], want, params["w"])
  adamw = optax.adamw(lr, weight_decay=wd, **ADAMW)
  want_b = _run_alone(adamw, params["b"], [jnp.asarray(g["b"], jnp.float32) for g in clipped])
  np.testing.assert_allclose([p["b"] for p in got], want_b, rtol=1e-5, atol=1e-6)


def test_schedule_learning_rate():
  params, grads = _matrix_and_bias()
  schedule = lambda count: 0.1 / (1.0 + count)
  wd = 0.1
  tx = dion_jax.dion(schedule, rank_fraction=RANK_FRACTION, weight_decay=wd, backend="xla")
  got, q0, _ = _run(tx, params, grads)
  dirs = _reference_directions(q0, [g["w"] for g in grads])
  lrs = [schedule(t) for t in range(len(grads))]  # step t (from 0) uses lr(t)
  _assert_trajectory([p["w"] for p in got], _reference_trajectory(params["w"], dirs, lrs, wd), params["w"])
  want_b = _run_alone(optax.adamw(schedule, weight_decay=wd, **ADAMW), params["b"], [g["b"] for g in grads])
  np.testing.assert_allclose([p["b"] for p in got], want_b, rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_learning_rate_changed_between_steps():
  params, grads = _matrix_and_bias(steps=5)
  lrs, wd = [0.05, 0.05, 0.01, 0.2, 0.0], 0.1
  tx = optax.inject_hyperparams(dion_jax.dion, static_args=dion_jax.STATIC_ARGS)(
      learning_rate=lrs[0], rank_fraction=RANK_FRACTION, weight_decay=wd,
      labels=_labels(w="dion", b="adamw"), backend="xla",
  )  # fmt: skip

  def set_lr(t, state):
    state.hyperparams["learning_rate"] = jnp.asarray(lrs[t], jnp.float32)
    return state

  got, q0, traces = _run(tx, params, grads, edit_state=set_lr)
  assert traces == 1  # the learning rate lives in the state, not in the trace
  dirs = _reference_directions(q0, [g["w"] for g in grads])
  want = _reference_trajectory(params["w"], dirs, lrs, wd)
  _assert_trajectory([p["w"] for p in got[:-1]], want[:-1], params["w"])
  np.testing.assert_array_equal(got[-1]["w"], got[-2]["w"])  # lr 0: no step at all

  adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=lrs[0], weight_decay=wd, **ADAMW)
  state, b, want_b = adamw.init(params["b"]), params["b"], []
  for t, g in enumerate(grads):
    state.hyperparams["learning_rate"] = jnp.asarray(lrs[t], jnp.float32)
    upd, state = adamw.update(g["b"], state, b)
    b = optax.apply_updates(b, upd)
    want_b.append(b)
  np.testing.assert_allclose([p["b"] for p in got], want_b, rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_accepts_callable_static_args():
  """Callables that are not schedules (labels, scale_rule, dtypes) stay static."""
  params, grads = _matrix_and_bias(steps=2)
  kwargs = dict(
      rank_fraction=RANK_FRACTION, labels=_labels(w="dion", b="lion"), scale_rule=lambda o, i: 2.0,
      momentum_dtype=jnp.float32, backend="xla",
  )  # fmt: skip
  injected = optax.inject_hyperparams(dion_jax.dion, static_args=dion_jax.STATIC_ARGS)(0.02, **kwargs)
  got, _, _ = _run(injected, params, grads)
  plain, _, _ = _run(dion_jax.dion(0.02, **kwargs), params, grads)
  for a, b in zip(got, plain):
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a["b"], b["b"], rtol=1e-6, atol=1e-6)


STATIC_ARGS = {"dion": "STATIC_ARGS", "muon": "MUON_STATIC_ARGS", "normuon": "NORMUON_STATIC_ARGS",
               "dion2": "DION2_STATIC_ARGS", "nordion2": "NORDION2_STATIC_ARGS"}


@pytest.mark.parametrize("name", STATIC_ARGS)
def test_inject_hyperparams_bare_and_with_static_args(name):
  """Each optimizer under ``optax.inject_hyperparams``, bare (every number an array in the
  state, as optax's own aliases take it) and with its static_args, steps as the optimizer
  itself (measured: 1e-9) and follows a learning rate changed in the state between steps.
  A structural number in the bare form fails at the first call, naming the static_args."""
  factory = getattr(dion_jax, name)
  params, grads = _matrix_and_bias(steps=3)
  lrs = [0.02, 0.05, 0.0]

  def run(tx):
    @jax.jit
    def step(params, state, g):
      upd, state = tx.update(g, state, params)
      return optax.apply_updates(params, upd), state

    out, state = [params], tx.init(params)
    for lr, g in zip(lrs, grads):
      state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
      new, state = step(out[-1], state, g)
      out.append(new)
    return out

  want, state = [params], factory(lrs[0]).init(params)
  for lr, g in zip(lrs, grads):  # the plain optimizer, rebuilt with each step's lr, its state carried
    upd, state = factory(lr).update(g, state, want[-1])
    want.append(optax.apply_updates(want[-1], upd))
  static = getattr(dion_jax, STATIC_ARGS[name])
  for tx in (optax.inject_hyperparams(factory)(learning_rate=lrs[0]),
             optax.inject_hyperparams(factory, static_args=static)(learning_rate=lrs[0])):
    for got, ref in zip(run(tx), want):
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref)
  structural = {"dion": {"rank_fraction": 0.5}, "dion2": {"fraction": 0.5}, "nordion2": {"fraction": 0.5}}
  with pytest.raises(ValueError, match=f"static_args=dion_jax.{STATIC_ARGS[name]}"):
    optax.inject_hyperparams(factory)(learning_rate=0.02, **structural.get(name, {"num_heads": 2})).init(params)


def test_multi_steps_applies_the_averaged_gradient():
  k, macro_steps, lr, wd = 3, 2, 0.05, 0.1
  params, grads = _matrix_and_bias(steps=k * macro_steps)
  tx = optax.MultiSteps(
      dion_jax.dion(lr, rank_fraction=RANK_FRACTION, weight_decay=wd, backend="xla"), every_k_schedule=k
  )
  got, _, _ = _run(tx, params, grads)
  q0 = _dion_q(tx.init(params))
  for t in range(len(grads)):
    if (t + 1) % k:  # micro-steps leave the parameters alone
      prev = params if t < k else got[t - (t % k) - 1]
      np.testing.assert_array_equal(got[t]["w"], prev["w"])
  mean = [
      {name: np.mean([np.asarray(g[name], np.float64) for g in grads[i * k : (i + 1) * k]], axis=0) for name in params}
      for i in range(macro_steps)
  ]  # fmt: skip
  dirs = _reference_directions(q0, [g["w"] for g in mean])
  want = _reference_trajectory(params["w"], dirs, [lr] * macro_steps, wd)
  _assert_trajectory([got[(i + 1) * k - 1]["w"] for i in range(macro_steps)], want, params["w"])
  want_b = _run_alone(optax.adamw(lr, weight_decay=wd, **ADAMW), params["b"], [jnp.asarray(g["b"], jnp.float32) for g in mean])
  np.testing.assert_allclose([got[(i + 1) * k - 1]["b"] for i in range(macro_steps)], want_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qr_method", ["shifted_cqr", "rcqr", "cqr", "qr"])
def test_jit_traces_once(qr_method):
  """No recompilation across steps, through a schedule and the cqr warmup switch."""
  params, grads = _matrix_and_bias(steps=6)
  tx = dion_jax.dion(
      optax.cosine_decay_schedule(0.05, 10), rank_fraction=RANK_FRACTION, qr_method=qr_method,
      cqr_warmup_steps=2, backend="xla",
  )  # fmt: skip
  got, q0, traces = _run(tx, params, grads)
  assert traces == 1
  dirs = _reference_directions(q0, [g["w"] for g in grads])
  lrs = [float(optax.cosine_decay_schedule(0.05, 10)(t)) for t in range(len(grads))]
  _assert_trajectory([p["w"] for p in got], _reference_trajectory(params["w"], dirs, lrs, 0.01), params["w"])


# --- Flax NNX -----------------------------------------------------------------------


class _TinyLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, vocab=40, d=16):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
    self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
    self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens_BxL):
    x_BxLxD = self.embed(tokens_BxL)
    x_BxLxD = x_BxLxD + self.fc2(jax.nn.relu(self.fc1(x_BxLxD)))
    return self.lm_head(x_BxLxD)


def _lm_loss(model, tokens_BxL):
  logits_BxLxV = model(tokens_BxL[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, tokens_BxL[:, 1:]).mean()


def test_nnx_optimizer():
  lr, wd, steps = 0.02, 0.1, 3
  model = _TinyLM(nnx.Rngs(0))
  params0 = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tx = dion_jax.dion(lr, rank_fraction=RANK_FRACTION, weight_decay=wd, backend="xla")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  q0 = optax.tree.get_all_with_path(tx.init(nnx.state(model, nnx.Param)), "q")[0][1]
  q0_fc1 = jnp.asarray(q0["fc1"]["kernel"][...])

  @nnx.jit
  def train_step(model, optimizer, tokens):
    grads = nnx.grad(_lm_loss)(model, tokens)
    optimizer.update(model, grads)
    return nnx.to_pure_dict(grads)

  tokens = jax.random.randint(jax.random.key(1), (steps, 4, 9), 0, 40)
  grads = [train_step(model, optimizer, tokens[t]) for t in range(steps)]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  # A Dion matrix: scale_by_dion, decoupled weight decay and the learning rate, by hand.
  chain = optax.chain(
      dion_jax.scale_by_dion(rank_fraction=RANK_FRACTION, backend="xla"),
      optax.add_decayed_weights(wd),
      optax.scale_by_learning_rate(lr),
  )
  state = chain.init({"k": params0["fc1"]["kernel"]})
  state = optax.tree.set(state, q={"k": q0_fc1})
  by_hand = _run_alone_with_state(chain, state, {"k": params0["fc1"]["kernel"]}, [{"k": g["fc1"]["kernel"]} for g in grads])
  np.testing.assert_allclose(params["fc1"]["kernel"], by_hand["k"], rtol=1e-4, atol=1e-5)
  assert not np.allclose(params["fc1"]["kernel"], params0["fc1"]["kernel"], atol=1e-3)

  # Everything else: optax's AdamW, alone (lm_head's lr scale is 1 with AdamW).
  for path in (("embed", "embedding"), ("fc1", "bias"), ("fc2", "bias"), ("lm_head", "kernel")):
    get = lambda tree: tree[path[0]][path[1]]
    want = _run_alone(optax.adamw(lr, weight_decay=wd, **ADAMW), get(params0), [get(g) for g in grads])[-1]
    np.testing.assert_allclose(get(params), want, rtol=1e-5, atol=1e-6, err_msg=str(path))


def _run_alone_with_state(tx, state, params, grads):
  for g in grads:
    upd, state = tx.update(g, state, params)
    params = optax.apply_updates(params, upd)
  return params


# --- Routing ------------------------------------------------------------------------

VOCAB, D_MODEL, SEQ = 64, 32, 8


class _Block(nn.Module):
  d: int

  @nn.compact
  def __call__(self, x_BxLxD):
    h_BxLxD = nn.RMSNorm(name="ln_1")(x_BxLxD)
    qkv_BxLx3D = nn.Dense(3 * self.d, name="qkv")(h_BxLxD)
    x_BxLxD = x_BxLxD + nn.Dense(self.d, name="proj")(qkv_BxLx3D[..., : self.d])
    h_BxLxD = nn.LayerNorm(name="ln_2")(x_BxLxD)
    h_BxLx4D = nn.relu(nn.Dense(4 * self.d, name="fc1")(h_BxLxD)) ** 2
    return x_BxLxD + nn.Dense(self.d, name="fc2")(h_BxLx4D)


class _LinenGPT(nn.Module):
  @nn.compact
  def __call__(self, tokens_BxL):
    x_BxLxD = nn.Embed(VOCAB, D_MODEL, name="wte")(tokens_BxL)
    x_BxLxD = x_BxLxD + nn.Embed(SEQ, D_MODEL, name="wpe")(jnp.arange(tokens_BxL.shape[1]))
    for i in range(2):
      x_BxLxD = _Block(D_MODEL, name=f"h_{i}")(x_BxLxD)
    x_BxLxD = nn.RMSNorm(name="ln_f")(x_BxLxD)
    return nn.Dense(VOCAB, use_bias=False, name="lm_head")(x_BxLxD)


def _linen_params():
  return _LinenGPT().init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


def _expected_labels(scalar):
  block = {
      "ln_1": {"scale": scalar},
      "qkv": {"kernel": "dion", "bias": scalar},
      "proj": {"kernel": "dion", "bias": scalar},
      "ln_2": {"scale": scalar, "bias": scalar},
      "fc1": {"kernel": "dion", "bias": scalar},
      "fc2": {"kernel": "dion", "bias": scalar},
  }
  return {
      "params": {
          "wte": {"embedding": scalar},
          "wpe": {"embedding": scalar},
          "h_0": block,
          "h_1": block,
          "ln_f": {"scale": scalar},
          "lm_head": {"kernel": "lm_head"},
      }
  }


@pytest.mark.parametrize("scalar", ["adamw", "lion"])
def test_default_labels_on_linen_gpt(scalar):
  params = jax.tree.map(lambda x: x, _linen_params())  # a plain dict
  assert dion_jax.default_labels(params, scalar) == _expected_labels(scalar)


def test_default_labels_other_embedding_and_head_names():
  params = {
      "tok_embeddings": jnp.ones((10, 4)),
      "Embed_0": {"embedding": jnp.ones((10, 4))},
      "layers": {"kernel": jnp.ones((3, 4, 8)), "scalar": jnp.ones(())},
      "unembed": {"kernel": jnp.ones((4, 10))},
  }
  assert dion_jax.default_labels(params) == {
      "tok_embeddings": "adamw",
      "Embed_0": {"embedding": "adamw"},
      "layers": {"kernel": "dion", "scalar": "adamw"},
      "unembed": {"kernel": "lm_head"},
  }


def _linen_grads(params, steps=3):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(7), steps * len(leaves)).reshape(steps, len(leaves))
  return [
      jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys[t], leaves)])
      for t in range(steps)
  ]


def _leaf(tree, *path):
  for p in path:
    tree = tree[p]
  return tree


@pytest.mark.parametrize("head_scale", [None, 0.25])
def test_lion_scalar_optimizer_and_lm_head_scale(head_scale):
  lr, wd = 3e-3, 0.1
  params = _linen_params()
  grads = _linen_grads(params)
  tx = dion_jax.dion(
      lr, scalar_optimizer="lion", weight_decay=wd, lm_head_lr_scale=head_scale, backend="xla"
  )
  got = _run_alone(tx, params, grads)[-1]
  scale = 1 / math.sqrt(D_MODEL) if head_scale is None else head_scale
  cases = {
      ("params", "lm_head", "kernel"): lr * scale,
      ("params", "ln_f", "scale"): lr,
      ("params", "wte", "embedding"): lr,
      ("params", "h_1", "fc1", "bias"): lr,
  }
  for path, leaf_lr in cases.items():
    lion = optax.lion(leaf_lr, b1=0.9, b2=0.95, weight_decay=wd)
    want = _run_alone(lion, _leaf(params, *path), [_leaf(g, *path) for g in grads])[-1]
    np.testing.assert_allclose(_leaf(got, *path), want, rtol=1e-6, atol=1e-7, err_msg=str(path))
  # The head's step is the scaled one: not the unscaled Lion step.
  path = ("params", "lm_head", "kernel")
  unscaled = _run_alone(optax.lion(lr, b1=0.9, b2=0.95, weight_decay=wd), _leaf(params, *path), [_leaf(g, *path) for g in grads])[-1]
  assert not np.allclose(_leaf(got, *path), unscaled, atol=1e-4)


@pytest.mark.parametrize("make", [dion_jax.dion, dion_jax.dion2, dion_jax.nordion2, dion_jax.normuon])
def test_scalar_weight_decay_is_the_scalar_groups_own(make):
  """scalar_weight_decay=0 (the reference's recipe for embeddings and LM head): the
  scalar leaves follow optax's AdamW without decay, the matrices are as before."""
  lr, wd = 3e-3, 0.1
  params = _linen_params()
  grads = _linen_grads(params)
  got = _run_alone(make(lr, weight_decay=wd, scalar_weight_decay=0.0), params, grads)[-1]
  alike = _run_alone(make(lr, weight_decay=wd), params, grads)[-1]
  for path in [("params", "lm_head", "kernel"), ("params", "wte", "embedding"), ("params", "ln_f", "scale")]:
    adamw = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.0)
    want = _run_alone(adamw, _leaf(params, *path), [_leaf(g, *path) for g in grads])[-1]
    np.testing.assert_allclose(_leaf(got, *path), want, rtol=1e-6, atol=1e-7, err_msg=str(path))
    assert not np.allclose(_leaf(alike, *path), want, rtol=1e-6, atol=1e-7), path
  path = ("params", "h_1", "fc1", "kernel")
  # Two differently partitioned optimizers: the same matrix step up to rounding (0 here).
  np.testing.assert_allclose(_leaf(got, *path), _leaf(alike, *path), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("as_callable", [False, True])
def test_user_labels(as_callable):
  lr, wd = 0.05, 0.1
  params, grads = _matrix_and_bias()
  params["v"] = params["w"] + 1.0  # a matrix sent to AdamW by the user
  for g in grads:
    g["v"] = g["w"] * 0.5
  tree = {"w": "dion", "v": "adamw", "b": "lion"}
  labels = (lambda p: dict(tree)) if as_callable else tree
  got, q0, _ = _run(dion_jax.dion(lr, rank_fraction=RANK_FRACTION, weight_decay=wd, labels=labels, backend="xla"), params, grads)
  dirs = _reference_directions(q0, [g["w"] for g in grads])
  _assert_trajectory([p["w"] for p in got], _reference_trajectory(params["w"], dirs, [lr] * len(grads), wd), params["w"])
  want_v = _run_alone(optax.adamw(lr, weight_decay=wd, **ADAMW), params["v"], [g["v"] for g in grads])
  np.testing.assert_allclose([p["v"] for p in got], want_v, rtol=1e-5, atol=1e-6)
  want_b = _run_alone(optax.lion(lr, b1=0.9, b2=0.95, weight_decay=wd), params["b"], [g["b"] for g in grads])
  np.testing.assert_allclose([p["b"] for p in got], want_b, rtol=1e-5, atol=1e-6)


def test_muon_label_matches_optax_muon():
  lr, mu, wd = 0.02, 0.9, 0.1
  params, grads = _matrix_and_bias()
  tx = dion_jax.dion(lr, mu=mu, weight_decay=wd, labels={"w": "muon", "b": "adamw"}, backend="xla")
  got = _run_alone(tx, params, grads)
  muon = optax.contrib.muon(lr, beta=mu, weight_decay=wd)
  want = _run_alone(muon, {"w": params["w"]}, [{"w": g["w"]} for g in grads])
  np.testing.assert_allclose([p["w"] for p in got], [p["w"] for p in want], rtol=1e-5, atol=1e-6)
  assert not np.allclose(got[-1]["w"], params["w"], atol=1e-3)


# --- Errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(learning_rate=-0.1), "learning_rate"),
        (dict(mu=-0.5), "mu"),
        (dict(rank_fraction=0.0), "rank_fraction"),
        (dict(rank_fraction=1.5), "rank_fraction"),
        (dict(qr_method="svd"), "qr_method"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(scalar_optimizer="sgd"), "scalar_optimizer"),
        (dict(scalar_learning_rate=-1.0), "scalar_learning_rate"),
        (dict(b1=1.0), "b1"),
        (dict(lm_head_lr_scale=0.0), "lm_head_lr_scale"),
        (dict(scale_rule="bogus"), "scale_rule"),
    ],
)
def test_bad_hyperparameters(kwargs, word):
  with pytest.raises(ValueError, match=word):
    dion_jax.dion(**kwargs)


def test_accepted_values_are_named():
  with pytest.raises(ValueError, match=r"\(0, 1\]"):
    dion_jax.dion(rank_fraction=2.0)
  with pytest.raises(ValueError, match="rcqr"):
    dion_jax.dion(qr_method="householder")


@pytest.mark.parametrize("as_callable", [False, True])
def test_unknown_label(as_callable):
  params, _ = _matrix_and_bias()
  tree = {"w": "dion", "b": "sgd"}
  tx = dion_jax.dion(labels=(lambda p: tree) if as_callable else tree)
  with pytest.raises(ValueError, match="sgd"):
    tx.init(params)


def test_vector_labelled_dion():
  params, _ = _matrix_and_bias()
  tx = dion_jax.dion(labels={"w": "dion", "b": "dion"})
  with pytest.raises(ValueError, match=r"\['b'\].*shape \(40,\)"):
    tx.init(params)


def test_muon_label_on_stacked_matrices_is_muon_per_matrix():
  """optax's Muon alone sends 3-D parameters to Adam; under dion they get Muon per layer."""
  lr, mu, wd, layers = 0.02, 0.9, 0.1, 3
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=(layers, FAN_IN, FAN_OUT)), jnp.float32)}
  grads = [{"w": jnp.asarray(rng.normal(size=(layers, FAN_IN, FAN_OUT)), jnp.float32)} for _ in range(3)]
  got = _run_alone(dion_jax.dion(lr, mu=mu, weight_decay=wd, labels={"w": "muon"}), params, grads)[-1]
  muon = optax.contrib.muon(lr, beta=mu, weight_decay=wd)
  for layer in range(layers):
    want = _run_alone(muon, {"w": params["w"][layer]}, [{"w": g["w"][layer]} for g in grads])[-1]
    np.testing.assert_allclose(got["w"][layer], want["w"], rtol=1e-5, atol=1e-6, err_msg=str(layer))
