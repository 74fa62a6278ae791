"""Muon, NorMuon, Dion2 and NorDion2 on the (rp, fs, tp, pp) mesh equal one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dion_jax
from tests import mesh_cases
from tests.mesh_cases import MESHES, jitted_step

# A column-parallel and a row-parallel stacked kernel, and a vector (compile time).
SHAPES = {k: mesh_cases.SHAPES[k] for k in ("qkv", "fc2", "norm")}
SPECS = {k: mesh_cases.SPECS[k] for k in SHAPES}


def _params():
  return {k: v for k, v in mesh_cases.params().items() if k in SHAPES}

OPTIMIZERS = {
    "muon": lambda **kw: dion_jax.muon(nesterov=True, **kw),
    "normuon": lambda **kw: dion_jax.normuon(num_heads={"qkv": 6}, **kw),
    "dion2_global": lambda **kw: dion_jax.dion2(selection_scope="global", **kw),
    "nordion2": lambda **kw: dion_jax.nordion2(**kw),
}


def _run_both(make, mesh, steps=2, ortho_dtype=jnp.float32):
  rp = dict(mesh.shape)["rp"]
  kw = dict(learning_rate=0.02, weight_decay=0.1, ortho_dtype=ortho_dtype, partition_specs=SPECS)
  tx_one, tx_mesh = make(**kw), make(mesh=mesh, **kw)
  labels = dion_jax.default_labels(_params())
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  params_one = _params()
  params_mesh = {k: put(v, SPECS[k]) for k, v in params_one.items()}
  state_one, state_mesh = tx_one.init(params_one), jax.jit(tx_mesh.init)(params_mesh)
  step_one, step_mesh = jitted_step(tx_one), jitted_step(tx_mesh)
  rng = np.random.default_rng(1)
  for _ in range(steps):
    per_replica = {k: rng.normal(size=(rp,) + s).astype(np.float32) for k, s in SHAPES.items()}
    mean = {k: g.mean(0) for k, g in per_replica.items()}
    grads_mesh = {
        k: put(per_replica[k], P("rp", *SPECS[k])) if rp > 1 and labels[k] == "dion" else put(mean[k], SPECS[k])
        for k in SHAPES
    }  # fmt: skip
    params_one, state_one = step_one(params_one, state_one, mean)
    params_mesh, state_mesh = step_mesh(params_mesh, state_mesh, grads_mesh)
  return params_one, params_mesh, state_mesh


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mesh_equals_single_device(name, mesh_spec):
  mesh = dion_jax.make_mesh(mesh_spec)
  one, sharded, state = _run_both(OPTIMIZERS[name], mesh)
  for k in SHAPES:
    np.testing.assert_allclose(
        np.asarray(sharded[k]), one[k], rtol=1e-5, atol=1e-5 * float(jnp.abs(one[k]).max()), err_msg=k
    )
  momentum = optax.tree.get(state, "momentum")
  for k in ("qkv", "fc2"):  # State lies like its parameter: no full copy anywhere.
    assert momentum[k].sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), momentum[k].ndim), k


@pytest.mark.parametrize("mesh_spec", ["rp=8", "rp=2,tp=4"])
def test_dion2_local_equals_global_without_fs(mesh_spec):
  """In a GPT the selected (shorter) side is the fs-sharded one: without fs, each
  shard's own top-k is the whole matrix's."""
  mesh = dion_jax.make_mesh(mesh_spec)
  one, sharded, _ = _run_both(lambda **kw: dion_jax.dion2(selection_scope="local", **kw), mesh)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(sharded[k]), one[k], rtol=1e-5, atol=1e-5 * float(jnp.abs(one[k]).max()))


def test_dion2_local_selects_per_shard():
  """With fs = 4 each shard takes its own top ceil(fraction·s/4) slices: the update
  then differs from the exact top-k, and touches the same number of slices per shard."""
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  one, sharded, _ = _run_both(lambda **kw: dion_jax.dion2(selection_scope="local", **kw), mesh, steps=1)
  params0 = _params()
  # fc2 (4D, D) in Flax layout: fan_out D = 32 is the shorter side, split 4 ways over fs.
  decayed_only = (1 - 0.02 * 0.1) * np.asarray(params0["fc2"])
  moved = np.abs(np.asarray(sharded["fc2"]) - decayed_only).max(axis=-2) > 1e-6  # (stages, layers, D)
  per_shard = moved.reshape(-1, 4, 8).sum(-1)  # fs splits D = 32 into 4 shards of 8; ceil(8/4) = 2 each.
  np.testing.assert_array_equal(per_shard, 2)
  assert not np.allclose(np.asarray(sharded["fc2"]), one["fc2"], atol=1e-6)


@pytest.mark.parametrize("name", ["muon", "dion2_global"])
def test_bf16_travels_as_bits(name):
  """bf16 blocks cross the mesh as uint16 bit patterns (Dion2's reduce-scatter adds
  them to zeros): the same bf16 computation as on one device."""
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  one, sharded, _ = _run_both(OPTIMIZERS[name], mesh, steps=1, ortho_dtype=jnp.bfloat16)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(sharded[k]), one[k], rtol=1e-5, atol=1e-5 * float(jnp.abs(one[k]).max()))
