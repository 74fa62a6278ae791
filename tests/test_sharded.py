"""Dion on the (rp, fs, tp, pp) mesh equals single-device Dion on the averaged gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dion_jax
from dion_jax import mesh as mesh_lib
from dion_jax import sharded

D, V, STAGES, LAYERS = 32, 64, 2, 2
SHAPES = {
    "embed": (V, D),
    "qkv": (STAGES, LAYERS, D, 3 * D),
    "out": (STAGES, LAYERS, D, D),
    "fc1": (STAGES, LAYERS, D, 4 * D),
    "fc2": (STAGES, LAYERS, 4 * D, D),
    "norm": (STAGES, LAYERS, D),
    "lm_head": (D, V),
}
SPECS = {
    "embed": mesh_lib.embedding(),
    "qkv": mesh_lib.stacked(mesh_lib.column_parallel(), 2),
    "out": mesh_lib.stacked(mesh_lib.row_parallel(), 2),
    "fc1": mesh_lib.stacked(mesh_lib.column_parallel(), 2),
    "fc2": mesh_lib.stacked(mesh_lib.row_parallel(), 2),
    "norm": P("pp", None, None),
    "lm_head": mesh_lib.column_parallel(),
}
MESHES = ["rp=2,fs=2,tp=2", "fs=4,tp=2", "rp=8", "fs=2,tp=2,pp=2", "rp=2,fs=4"]


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def _step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize(
    "mesh_spec, replicate_sync",
    [(m, True) for m in MESHES] + [("rp=2,fs=2,tp=2", False), ("rp=8", False)],
)
def test_sharded_equals_single_device(mesh_spec, replicate_sync):
  mesh = mesh_lib.make_mesh(mesh_spec)
  rp = dict(mesh.shape)["rp"]
  kw = dict(learning_rate=0.02, rank_fraction=0.25, partition_specs=SPECS, backend="xla")
  tx_one = dion_jax.dion(**kw)
  tx_mesh = dion_jax.dion(mesh=mesh, replicate_sync=replicate_sync, **kw)
  labels = dion_jax.default_labels(_params())
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))

  params_one = _params()
  params_mesh = {k: put(v, SPECS[k]) for k, v in params_one.items()}
  state_one, state_mesh = tx_one.init(params_one), jax.jit(tx_mesh.init)(params_mesh)
  step_one, step_mesh = _step(tx_one), _step(tx_mesh)
  rng = np.random.default_rng(1)
  for _ in range(3):
    per_replica = {k: rng.normal(size=(rp,) + s).astype(np.float32) for k, s in SHAPES.items()}
    mean = {k: g.mean(0) for k, g in per_replica.items()}
    grads_mesh = {
        k: put(per_replica[k], P("rp", *SPECS[k]))
        if replicate_sync and rp > 1 and labels[k] == "dion"
        else put(mean[k], SPECS[k])
        for k in SHAPES
    }  # fmt: skip
    params_one, state_one = step_one(params_one, state_one, mean)
    params_mesh, state_mesh = step_mesh(params_mesh, state_mesh, grads_mesh)
    for k in SHAPES:
      np.testing.assert_allclose(
          np.asarray(params_mesh[k]), params_one[k], rtol=1e-5, atol=1e-5 * float(jnp.abs(params_one[k]).max()),
          err_msg=k,
      )  # fmt: skip


def _dion_state(state):
  return optax.tree.get(state, "momentum"), optax.tree.get(state, "q")


def test_state_is_sharded_like_its_parameter():
  mesh = mesh_lib.make_mesh("fs=4,tp=2")
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in _params().items()}
  tx = dion_jax.scale_by_dion(rank_fraction=0.25, mesh=mesh, partition_specs=SPECS)
  dion_params = {k: params[k] for k in ("qkv", "out", "fc1", "fc2")}
  state = jax.jit(tx.init)(dion_params)
  for k in dion_params:
    M, Q = state.momentum[k], state.q[k]
    assert M.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), M.ndim), k
    local_m = M.addressable_shards[0].data
    assert local_m.size == M.size // 8, k  # fs x tp = 8 ways, no full copy anywhere.
    fr = dion_jax.matrix_frame(M.shape, dion_jax.DionDimensionNumbers(), 0.25, 1, SPECS[k])
    assert Q.shape == fr.q_shape
    assert Q.addressable_shards[0].data.size == Q.size // 4, k  # Q's rows split over fs.


def test_compressed_momentum_has_replica_axis_and_averages():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  tx = dion_jax.scale_by_dion(rank_fraction=0.25, mesh=mesh, partition_specs=SPECS)
  dion_params = {k: _params()[k] for k in ("qkv", "fc1")}
  state = jax.jit(tx.init)(dion_params)
  M = state.momentum["qkv"]
  assert M.shape == (2,) + SHAPES["qkv"] and M.sharding.spec[0] == "rp"
  rng = np.random.default_rng(0)
  grads = {k: rng.normal(size=(2,) + v.shape).astype(np.float32) for k, v in dion_params.items()}
  _, state = jax.jit(tx.update)(grads, state)
  # Each replica's momentum is its own; their mean is what one device holds.
  tx_one = dion_jax.scale_by_dion(rank_fraction=0.25, partition_specs=SPECS)
  _, state_one = tx_one.update({k: g.mean(0) for k, g in grads.items()}, tx_one.init(dion_params))
  M = np.asarray(state.momentum["qkv"])
  assert not np.allclose(M[0], M[1])
  np.testing.assert_allclose(M.mean(0), state_one.momentum["qkv"], atol=1e-5)
  avg = sharded.average_replicas(state.momentum, 2)
  np.testing.assert_allclose(avg["qkv"][1], M.mean(0), atol=1e-6)


def test_value_and_grad_per_replica():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.zeros(4)}
  batch = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
  loss_fn = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)
  vg = sharded.value_and_grad_per_replica(loss_fn, mesh, {"w": True, "b": False})
  loss, grads = jax.jit(vg)(params, batch)
  halves = [jax.value_and_grad(loss_fn)(params, batch[i * 3 : (i + 1) * 3]) for i in range(2)]
  np.testing.assert_allclose(loss, (halves[0][0] + halves[1][0]) / 2, rtol=1e-6)
  assert grads["w"].shape == (2, 8, 4)
  for i in range(2):
    np.testing.assert_allclose(grads["w"][i], halves[i][1]["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grads["b"], (halves[0][1]["b"] + halves[1][1]["b"]) / 2, rtol=1e-5, atol=1e-6)


def test_mesh_without_specs_is_an_error():
  mesh = mesh_lib.make_mesh("fs=8")
  tx = dion_jax.scale_by_dion(mesh=mesh)
  with pytest.raises(ValueError, match="partition_specs"):
    tx.init({"w": jnp.ones((16, 16))})


def test_partition_specs_of_reads_arrays():
  mesh = mesh_lib.make_mesh("fs=4,tp=2")
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("fs", "tp")))
  assert sharded.partition_specs_of({"x": x}) == {"x": P("fs", "tp")}


def test_indivisible_parameter_is_an_error():
  mesh = mesh_lib.make_mesh("fs=4,tp=2")
  tx = dion_jax.scale_by_dion(mesh=mesh, partition_specs={"w": mesh_lib.column_parallel()})
  with pytest.raises(ValueError, match=r"\['w'\].*dimension 0 of size 6"):
    tx.init({"w": jnp.ones((6, 16))})
