"""Tests for dion_jax.parallel.mesh: spec parsing, mesh construction, layouts and divisibility."""
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dion_jax.parallel import mesh as mesh_lib


@pytest.mark.parametrize("spec, expected", [
    ("rp=1,fs=2,tp=2", {"rp": 1, "fs": 2, "ep": 1, "cp": 1, "tp": 2, "pp": 1}),
    (" fs = 4 , tp=2 ", {"rp": 1, "fs": 4, "ep": 1, "cp": 1, "tp": 2, "pp": 1}),
    ("pp=2,rp=2,", {"rp": 2, "fs": 1, "ep": 1, "cp": 1, "tp": 1, "pp": 2}),
    ("cp=2,fs=2", {"rp": 1, "fs": 2, "ep": 1, "cp": 2, "tp": 1, "pp": 1}),
    ("", {"rp": 1, "fs": 1, "ep": 1, "cp": 1, "tp": 1, "pp": 1}),
])
def test_parse_mesh_spec(spec, expected):
  sizes = mesh_lib.parse_mesh_spec(spec)
  assert sizes == expected
  assert tuple(sizes) == ("rp", "fs", "ep", "cp", "tp", "pp")


@pytest.mark.parametrize("spec, pattern", [
    ("rp=2,dp=2", r"unknown axis 'dp'; use only rp, fs, ep, cp, tp, pp"),
    ("fs=2,tp=2,fs=2", r"axis 'fs' is given twice; give each axis at most once"),
    ("fs=0", r"size of axis 'fs' must be a positive integer, got '0'; write e.g. 'fs=2'"),
    ("tp=-2", r"size of axis 'tp' must be a positive integer, got '-2'"),
    ("tp=1.5", r"size of axis 'tp' must be a positive integer, got '1.5'"),
    ("tp=two", r"size of axis 'tp' must be a positive integer, got 'two'"),
    ("fs", r"item 'fs' is not axis=size"),
])
def test_parse_mesh_spec_errors(spec, pattern):
  with pytest.raises(ValueError, match=pattern) as info:
    mesh_lib.parse_mesh_spec(spec)
  assert "\n" not in str(info.value)


def test_make_mesh_axes_and_types():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  assert mesh.axis_names == ("rp", "fs", "ep", "cp", "tp", "pp")
  assert dict(mesh.shape) == {"rp": 2, "fs": 2, "ep": 1, "cp": 1, "tp": 2, "pp": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_from_mapping_and_devices():
  devices = jax.devices()[::-1]
  mesh = mesh_lib.make_mesh({"fs": 4, "tp": 2}, devices=devices)
  assert dict(mesh.shape) == {"rp": 1, "fs": 4, "ep": 1, "cp": 1, "tp": 2, "pp": 1}
  assert [d.id for d in mesh.devices.flat] == [7, 6, 5, 4, 3, 2, 1, 0]
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  sub = mesh_lib.make_mesh("tp=2", devices=jax.devices()[:2])
  assert sub.devices.shape == (1, 1, 1, 1, 2, 1)


@pytest.mark.parametrize("sizes, pattern", [
    ({"xp": 2}, r"unknown axis 'xp'"),
    ({"fs": 0}, r"size of axis 'fs' must be a positive integer"),
    ({"fs": 2.0}, r"size of axis 'fs' must be a positive integer"),
])
def test_make_mesh_mapping_errors(sizes, pattern):
  with pytest.raises(ValueError, match=pattern):
    mesh_lib.make_mesh(sizes)


def test_make_mesh_too_many_devices_names_the_cpu_flag():
  with pytest.raises(ValueError) as info:
    mesh_lib.make_mesh("fs=4,tp=4")
  msg = str(info.value)
  assert "\n" not in msg
  assert "needs 16 devices but 8 exist" in msg
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in msg


def test_make_mesh_too_few_devices_suggests_a_subset():
  with pytest.raises(ValueError, match=r"needs 4 devices but 8 exist.*devices=jax.devices\(\)\[:4\]"):
    mesh_lib.make_mesh("fs=2,tp=2")


def test_layout_specs():
  assert mesh_lib.column_parallel() == P("fs", "tp")
  assert mesh_lib.row_parallel() == P("tp", "fs")
  assert mesh_lib.embedding() == P("tp", "fs")
  assert mesh_lib.vector() == P()
  assert mesh_lib.stacked(mesh_lib.column_parallel()) == P("pp", "fs", "tp")
  assert mesh_lib.stacked(mesh_lib.column_parallel(), 2) == P("pp", None, "fs", "tp")
  assert mesh_lib.stacked(mesh_lib.vector(), 3) == P("pp", None, None)
  with pytest.raises(ValueError, match="n_leading must be >= 1"):
    mesh_lib.stacked(mesh_lib.vector(), 0)


def test_layouts_place_shards_as_megatron_does():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  x = jax.device_put(np.zeros((8, 12), np.float32),
                     jax.sharding.NamedSharding(mesh, mesh_lib.column_parallel()))
  # fan_in 8 over fs=2, fan_out 12 over tp=2.
  assert {s.data.shape for s in x.addressable_shards} == {(4, 6)}


def test_check_divisible_passes_and_fails():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  mesh_lib.check_divisible((8, 6), mesh_lib.column_parallel(), mesh)
  mesh_lib.check_divisible((2, 8, 5), mesh_lib.stacked(P("fs")), {"pp": 2, "fs": 2})
  with pytest.raises(ValueError) as info:
    mesh_lib.check_divisible((8, 6), P(None, ("fs", "tp")), mesh, name="mlp/up")
  msg = str(info.value)
  assert "\n" not in msg
  assert msg.startswith("mlp/up: dimension 1 of size 6")
  assert "mesh axes ('fs', 'tp') of total size 4" in msg
  assert "change the mesh or the model size" in msg


def test_check_divisible_spec_errors():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  with pytest.raises(ValueError, match="has 3 entries but the shape"):
    mesh_lib.check_divisible((4, 4), P("fs", "tp", None), mesh)
  with pytest.raises(ValueError, match="names axis 'dp' that the mesh lacks"):
    mesh_lib.check_divisible((4, 4), P("dp"), mesh)


def test_tree_check_divisible_names_the_leaf():
  mesh = mesh_lib.make_mesh("rp=2,fs=2,tp=2")
  params = {"blocks": {"up": jax.ShapeDtypeStruct((2, 8, 6), np.float32),
                       "down": jax.ShapeDtypeStruct((2, 8, 8), np.float32)},
            "norm": np.ones(5, np.float32)}
  good = {"blocks": {"up": P(None, "fs", "tp"), "down": P(None, "tp", "fs")}, "norm": None}
  mesh_lib.tree_check_divisible(params, good, mesh)
  bad = {"blocks": {"up": P(None, "fs", ("tp", "rp")), "down": P(None, "tp", "fs")}, "norm": P()}
  with pytest.raises(ValueError, match=r"^\['blocks'\]\['up'\]: dimension 2 of size 6"):
    mesh_lib.tree_check_divisible(params, bad, mesh)


def test_a_shard_map_nested_over_earlier_axes_compiles_with_the_flags():
  """The pipeline's shard_map over pp around one over fs (earlier in AXES), as the GPT nests
  them: with NESTED_SHARD_MAP_XLA_FLAGS (conftest sets them) it compiles and computes; without
  them, jaxlib 0.11 and newer abort the process while compiling it."""
  assert "--xla_enable_hlo_sharding_v3=false" in os.environ["XLA_FLAGS"].split()
  mesh = mesh_lib.make_mesh("fs=2,pp=2", devices=jax.devices()[:4])

  def stage(x):
    inner = jax.shard_map(lambda y: y * 2 + jax.lax.axis_index("fs"), mesh=jax.sharding.get_abstract_mesh(),
                          in_specs=P("fs"), out_specs=P("fs"), axis_names={"fs"})
    return inner(x) + jax.lax.axis_index("pp")

  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(stage, in_specs=P("pp"), out_specs=P("pp"), axis_names={"pp"}))
    out = np.asarray(f(np.arange(8.0, dtype=np.float32)))
  # x halves over pp, then quarters over fs within each half: + pp index, + fs index.
  np.testing.assert_array_equal(out, np.arange(8.0) * 2 + [0, 0, 1, 1, 1, 1, 2, 2])
