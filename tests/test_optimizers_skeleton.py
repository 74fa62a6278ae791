"""Megabatches: parameters of one geometry stepped as one stacked parameter by the
orthogonal family and Dion, against float64 NumPy per matrix (on a mesh, Dion against
its per-parameter step), and the orthogonalizations, factorizations and all-to-alls that
the grouping saves, counted in the HLO."""

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dion_jax
from dion_jax.accounting import hlo
from dion_jax.optimizers import skeleton
from tests import dion_reference_np
from tests import family_reference_np as ref

D, LAYERS, LR, WD = 16, 2, 0.02, 0.1
# A GPT block's kernels in Flax layout (layers, fan_in, fan_out). On one device: groups
# {query, key, value, out}, {gate, up}, {down}. On a mesh out and down are row-parallel:
# {query, key, value}, {out}, {gate, up}, {down}.
SHAPES = {"query": (D, D), "key": (D, D), "value": (D, D), "out": (D, D), "gate": (D, 4 * D), "up": (D, 4 * D),
          "down": (4 * D, D)}  # fmt: skip
ROW_PARALLEL = ("out", "down")
SPECS = {k: dion_jax.stacked(dion_jax.row_parallel() if k in ROW_PARALLEL else dion_jax.column_parallel(), 1)
         for k in SHAPES}  # fmt: skip
ALGORITHMS = {
    "muon": lambda **kw: dion_jax.muon(nesterov=True, **kw),
    "nordion2": lambda **kw: dion_jax.nordion2(fraction=0.3, **kw),
}


def _reference(name, X0_kernel, grads_kernel):
  """Float64 steps of one (fan_in, fan_out) kernel, matrix by matrix: [X] in Flax layout."""
  steps = {
      "muon": lambda X, G: ref.muon_steps(X, G, LR, wd=WD, nesterov=True),
      "nordion2": lambda X, G: ref.nordion2_steps(X, G, LR, fraction=0.3, wd=WD),
  }[name]
  per_layer = [steps(X0_kernel[i].T, [g[i].T for g in grads_kernel]) for i in range(LAYERS)]
  return [np.stack([layer[t][0].T for layer in per_layer]) for t in range(len(grads_kernel))]


def _params_and_grads(steps, rp=1):
  rng = np.random.default_rng(0)
  params = {k: rng.normal(size=(LAYERS,) + s) * 0.1 for k, s in SHAPES.items()}
  grads = [{k: rng.normal(size=(rp, LAYERS) + s) for k, s in SHAPES.items()} for _ in range(steps)]
  return params, grads


class Trajectory(NamedTuple):
  params: list  # after each step, float64
  state: object  # after the last step
  collectives: set  # the compiled step's collectives: (op, mesh axes)


def _trajectory(tx, params, grads, mesh=None) -> Trajectory:
  put = (lambda x, spec: jnp.asarray(x, jnp.float32)) if mesh is None else (
      lambda x, spec: jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec)))  # fmt: skip
  rp = 1 if mesh is None else dict(mesh.shape)["rp"]
  params = {k: put(v, SPECS[k]) for k, v in params.items()}
  state = jax.jit(tx.init)(params)

  def apply(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  out, step = [], None
  for g in grads:
    g = {k: put(v, P("rp", *SPECS[k])) if rp > 1 else put(v.mean(0), SPECS[k]) for k, v in g.items()}
    step = step or jax.jit(apply).lower(params, state, g).compile()
    params, state = step(params, state, g)
    out.append({k: np.asarray(v, np.float64) for k, v in params.items()})
  ops = set() if mesh is None else {(s.op, s.axes) for s in hlo.collective_stats(step, mesh)}
  return Trajectory(out, state, ops)


def _run(tx, params, grads, mesh=None):
  return _trajectory(tx, params, grads, mesh).params


def _assert_matches_reference(name, params, grads, got):
  """Each step within 1e-3 of its size, as the one-matrix tests (achieved: ~2e-5)."""
  for k in SHAPES:
    want = _reference(name, params[k], [g[k].mean(0) for g in grads])
    prev = params[k]
    for t, (g, w) in enumerate(zip(got, want)):
      assert np.linalg.norm(g[k] - w) <= 1e-3 * np.linalg.norm(w - prev), f"{name} {k} step {t}"
      prev = w


# Muon's plain step and NorDion2's selection and normalization (Dion2's and NorMuon's parts);
# NorDion2's also one parameter at a time (megabatch_bytes=1: the chunks' chain).
@pytest.mark.parametrize("name, megabatch_bytes", [("muon", None), ("nordion2", None), ("nordion2", 1)])
def test_megabatches_equal_each_matrix_alone(name, megabatch_bytes):
  params, grads = _params_and_grads(steps=2)
  tx = ALGORITHMS[name](learning_rate=LR, weight_decay=WD, ortho_dtype=jnp.float32, megabatch_bytes=megabatch_bytes)
  _assert_matches_reference(name, params, grads, _run(tx, params, grads))


def test_megabatches_on_a_mesh_equal_each_matrix_alone():
  """rp=2 (per-replica gradients: the replica axis stays in front of the stacking
  axis), fs=2, tp=2: each group's matrices split over the devices of their group."""
  mesh = dion_jax.make_mesh("rp=2,fs=2,tp=2")
  params, grads = _params_and_grads(steps=2, rp=2)
  tx = ALGORITHMS["nordion2"](learning_rate=LR, weight_decay=WD, ortho_dtype=jnp.float32, partition_specs=SPECS,
                              mesh=mesh)  # fmt: skip
  _assert_matches_reference("nordion2", params, grads, _run(tx, params, grads, mesh))


def _lowered_update(tx, tree, mesh=None):
  params = {k: jax.ShapeDtypeStruct((LAYERS,) + SHAPES[k], jnp.float32) for k in tree}
  if mesh is not None:
    params = {k: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, SPECS[k]))
              for k, p in params.items()}  # fmt: skip
  state = jax.eval_shape(tx.init, params)
  return jax.jit(lambda g, s: tx.update(g, s, g)[0]).lower(params, state)


def test_one_orthogonalization_per_group():
  """One device: Polar Express's 15 matmuls (5 steps of A, A², BX) once per group, 3
  groups instead of 7 parameters. The per-parameter count is measured on one-leaf trees."""
  tx = dion_jax.muon(LR, labels=lambda p: {k: "dion" for k in p})
  dots = lambda lowered: len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))
  per_parameter = sum(dots(_lowered_update(tx, [k])) for k in SHAPES)
  assert per_parameter == 7 * 15
  assert dots(_lowered_update(tx, list(SHAPES))) == 3 * 15


def test_one_dion_step_per_group():
  """One device: Dion's 4 products (B Q, Bᵀ P, the error feedback, the update) and
  shifted Cholesky QR's 8 (a Gram, three solve-and-Gram passes, the last solve) once per
  group, 3 groups instead of 7 parameters."""
  tx = dion_jax.scale_by_dion(rank_fraction=0.25, qr_method="shifted_cqr", backend="xla")
  dots = lambda lowered: len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))
  assert sum(dots(_lowered_update(tx, [k])) for k in SHAPES) == 7 * 12
  assert dots(_lowered_update(tx, list(SHAPES))) == 3 * 12


def test_one_all_to_all_exchange_per_group_on_a_mesh():
  """fs=4, tp=2: whole matrices gather over fs and tp and scatter back, 4 all-to-alls per
  group in the compiled program: 4 groups instead of 7 parameters."""
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  tx = dion_jax.muon(LR, partition_specs=SPECS, mesh=mesh, labels=lambda p: {k: "dion" for k in p})
  a2a = lambda lowered: len(re.findall(r"stablehlo\.all_to_all", lowered.as_text()))
  assert sum(a2a(_lowered_update(tx, [k], mesh)) for k in SHAPES) == 7 * 4
  stats = hlo.collective_stats(_lowered_update(tx, list(SHAPES), mesh).compile(), mesh)
  assert sum(s.count for s in stats if s.op == "all-to-all") == 4 * 4


# Dion: rank 1/4 of the shorter side (r = 4) on the block above; every leaf is Dion's.
DION = dict(learning_rate=LR, weight_decay=WD, rank_fraction=0.25, labels=lambda p: {k: "dion" for k in p},
            backend="xla")  # fmt: skip


def test_dion_megabatches_equal_float64_numpy_per_matrix():
  """One device, groups {query, key, value, out}, {gate, up}, {down}: each matrix of each
  layer follows its own float64 Dion (Householder QR) from its own Q. Achieved: the
  parameters within 7.4e-6 of a step, the last momenta within 6.3e-8 of their norm."""
  params, grads = _params_and_grads(steps=3)
  tx = dion_jax.dion(**DION)
  state = tx.init({k: jnp.asarray(v, jnp.float32) for k, v in params.items()})
  Q0 = {k: np.asarray(q, np.float64) for k, q in optax.tree.get(state, "q").items()}
  run = _trajectory(tx, params, grads)
  momentum = optax.tree.get(run.state, "momentum")
  for k in SHAPES:
    for layer in range(LAYERS):
      want = dion_reference_np.dion_steps(
          params[k][layer].T, Q0[k][layer], [g[k][0, layer].T for g in grads], lr=LR, mu=0.95, weight_decay=WD,
      )  # fmt: skip
      prev = params[k][layer].T
      for t, (X, _, _) in enumerate(want):
        assert np.linalg.norm(run.params[t][k][layer].T - X) <= 5e-5 * np.linalg.norm(X - prev), (k, layer, t)
        prev = X
      M = want[-1][1]
      assert np.linalg.norm(np.asarray(momentum[k][layer]).T - M) <= 5e-7 * np.linalg.norm(M), (k, layer)


def _per_parameter(monkeypatch):
  """Every parameter stepped alone, as before megabatches."""
  monkeypatch.setattr(skeleton, "_groups", lambda rule, views, leaves, states: [[i] for i in range(len(leaves))])


def test_dion_megabatches_on_a_mesh_equal_the_per_parameter_step(monkeypatch):
  """rp=2, fs=2, tp=2: compressed sync (a momentum per replica, in front of the stacking
  axis), and the gate/up megabatch of 2 x 2 local matrices splits its orthonormalizations
  over the 4 devices of its fs·rp group (P reduce-scattered over fs, then over rp, and
  gathered back, which no single parameter of 2 layers could: each averages its 1/fs part
  of P over rp by an all-reduce). Parameters and momenta equal the per-parameter
  step's; achieved: 4.7e-8 of the parameters' largest entry, 9.1e-8 of the momenta's."""
  mesh = dion_jax.make_mesh("rp=2,fs=2,tp=2")
  params, grads = _params_and_grads(steps=2, rp=2)
  kw = dict(DION, partition_specs=SPECS, mesh=mesh)
  megabatched = _trajectory(dion_jax.dion(**kw), params, grads, mesh)
  _per_parameter(monkeypatch)
  alone = _trajectory(dion_jax.dion(**kw), params, grads, mesh)
  spread = ("reduce-scatter", ("rp",))
  assert spread in megabatched.collectives and spread not in alone.collectives
  for k in SHAPES:
    for got, want in zip(megabatched.params, alone.params):
      np.testing.assert_allclose(got[k], want[k], rtol=0, atol=5e-7 * np.abs(want[k]).max(), err_msg=k)
    got, want = (np.asarray(optax.tree.get(run.state, "momentum")[k]) for run in (megabatched, alone))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=k)


def _chunk_of_two(tx, mesh=None):
  """``megabatch_bytes`` that holds two query kernels' gradient and state per device (the
  largest gradient per device of one replica, and the per-replica momentum where compressed):
  query, key, value (and out, on one device) go two at a time, the wider kernels alone."""
  params = {k: jnp.zeros((LAYERS,) + SHAPES[k], jnp.float32) for k in SHAPES}
  if mesh is not None:
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
  state = jax.jit(tx.init)(params)
  local = lambda x: x.addressable_shards[0].data.nbytes if mesh is not None else x.nbytes
  M, Q = optax.tree.get(state, "momentum")["query"], optax.tree.get(state, "q")["query"]
  return 2 * (2 * local(M) + local(Q))


def _averaged(grads):
  return [{k: g.mean(0, keepdims=True) for k, g in step.items()} for step in grads]


@functools.cache
def _dion_one_device() -> Trajectory:
  params, grads = _params_and_grads(steps=2, rp=2)
  return _trajectory(dion_jax.dion(**DION, partition_specs=SPECS), params, _averaged(grads))


@pytest.mark.parametrize("mesh_spec", [None, "rp=2,fs=2,tp=2", "fs=2,tp=2,pp=2"])
def test_chunked_megabatches_equal_one_device(mesh_spec):
  """Dion's megabatches ({query, key, value}, {out}, {gate, up}, {down}: out and down
  row-parallel) cut into chunks of two parameters ({query, key}, {value}, the rest alone)
  and stepped one after another, on one device, with compressed sync and Q split over tp (rp x fs x tp), and with the layers on
  pp: the parameters and the momenta's mean over replicas equal one device's unchunked run
  within 1e-6 of their largest entry (achieved: 0 on one device; on the meshes 9.3e-8 of the
  parameters, 1.3e-7 of the momenta)."""
  mesh = None if mesh_spec is None else dion_jax.make_mesh(mesh_spec)
  params, grads = _params_and_grads(steps=2, rp=2)
  if mesh is None or dict(mesh.shape)["rp"] == 1:
    grads = _averaged(grads)
  kw = dict(DION, partition_specs=SPECS) if mesh is None else dict(DION, partition_specs=SPECS, mesh=mesh, split_q=True)
  size = _chunk_of_two(dion_jax.dion(**kw), mesh)
  chunked = _trajectory(dion_jax.dion(**kw, megabatch_bytes=size), params, grads, mesh)
  want = _dion_one_device()
  for k in SHAPES:
    for got, ref_params in zip(chunked.params, want.params):
      np.testing.assert_allclose(got[k], ref_params[k], rtol=0, atol=1e-6 * np.abs(ref_params[k]).max(), err_msg=k)
    got, ref_m = (np.asarray(optax.tree.get(run.state, "momentum")[k]) for run in (chunked, want))
    got = got.mean(0) if got.ndim > ref_m.ndim else got
    np.testing.assert_allclose(got, ref_m, rtol=0, atol=1e-6 * np.abs(ref_m).max(), err_msg=k)


def test_chunks_run_one_after_another():
  """One device, chunks of two parameters: {query, key}, {value, out}, gate, up, down, five
  Dion steps of 12 products where the megabatches ran three, tied in a chain by four
  optimization barriers; ``megabatch_bytes=1``: every parameter alone, seven."""
  kw = dict(rank_fraction=0.25, qr_method="shifted_cqr", backend="xla")
  dots = lambda lowered: len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))
  # The chain's barriers tie many arrays; Dion's products keep one-array barriers of their own on CPU.
  barriers = lambda lowered: len(re.findall(r"stablehlo\.optimization_barrier %[^ ]+,", lowered.as_text()))
  two = _lowered_update(dion_jax.scale_by_dion(**kw, megabatch_bytes=_chunk_of_two(dion_jax.scale_by_dion(**kw))),
                        list(SHAPES))
  assert (dots(two), barriers(two)) == (5 * 12, 4)
  alone = _lowered_update(dion_jax.scale_by_dion(**kw, megabatch_bytes=1), list(SHAPES))
  assert (dots(alone), barriers(alone)) == (7 * 12, 6)
  assert barriers(_lowered_update(dion_jax.scale_by_dion(**kw), list(SHAPES))) == 0
