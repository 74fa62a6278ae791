"""One optimizer update's measured communication and state bytes, against bytes
counted by hand: Dion's compressed sync moves (m + n)·r values per matrix over rp
instead of m·n; Muon moves each bf16 block four times; Dion2 and NorDion2 a fraction of that."""

import jax

import dion_jax
from dion_jax import accounting

LAYERS, D_IN, D_OUT = 8, 256, 1024  # A stacked column-parallel kernel, Flax layout.


def _params(mesh, layers, d_in, d_out):
  return accounting.abstract_params({"w": (layers, d_in, d_out)},
                                    {"w": dion_jax.stacked(dion_jax.column_parallel())}, mesh)


def _dion(mesh, rank_fraction):
  specs = {"w": dion_jax.stacked(dion_jax.column_parallel())}
  return dion_jax.scale_by_dion(rank_fraction=rank_fraction, partition_specs=specs, mesh=mesh, backend="xla")


def _orthogonal(mesh, algorithm, **kwargs):
  specs = {"w": dion_jax.stacked(dion_jax.column_parallel())}
  return dion_jax.scale_by_orthogonal(algorithm, partition_specs=specs, mesh=mesh, backend="xla", **kwargs)


def _by_op(stats):
  out = {}
  for s in stats:
    out[(s.op, s.axes)] = out.get((s.op, s.axes), 0) + s.bytes
  return out


def test_compressed_sync_moves_m_plus_n_times_r_over_rp():
  mesh = dion_jax.make_mesh("rp=2", jax.devices()[:2])
  layers, d, r = 1, 256, 64
  stats = accounting.update_stats(_dion(mesh, 0.25), _params(mesh, layers, d, d), mesh, per_replica=True)
  over_rp = sum(s.bytes for s in stats if "rp" in s.axes)
  expected = layers * (d + d) * r * 4
  assert abs(over_rp - expected) <= 0.02 * expected
  # A single all-reduce of the m x n gradient over rp would alone exceed all of it.
  assert over_rp < d * d * 4


def test_uncompressed_matrices_average_their_gradient():
  mesh = dion_jax.make_mesh("rp=2", jax.devices()[:2])
  stats = accounting.update_stats(_dion(mesh, 1.0), _params(mesh, 2, 128, 128), mesh, per_replica=True)
  over_rp = sum(s.bytes for s in stats if s.axes == ("rp",))
  assert over_rp >= 2 * 128 * 128 * 4  # The whole gradient of both layers.


def test_state_bytes_split_over_fs_and_tp():
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  state = accounting.abstract_state(_dion(mesh, 0.25), _params(mesh, 2, 256, 256))
  local, whole = accounting.state_bytes(state)
  m_bytes, q_bytes, count = 2 * 256 * 256 * 4, 2 * 256 * 64 * 4, 4
  assert whole == m_bytes + q_bytes + count
  assert local == m_bytes // 8 + q_bytes // 4 + count  # M over fs x tp; Q's rows over fs.


def test_muon_moves_each_block_four_times_in_bf16_never_gathers():
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  got = _by_op(accounting.update_stats(_orthogonal(mesh, "muon"), _params(mesh, LAYERS, D_IN, D_OUT), mesh))
  block = LAYERS * D_IN * D_OUT // 8 * 2  # This device's bf16 block of the stack.
  # Over fs: (8, 64, 512) -> (2, 256, 512) and back; over tp: (2, 256, 512) -> (1, 256, 1024) and back.
  assert got == {("all-to-all", ("fs",)): 2 * block, ("all-to-all", ("tp",)): 2 * block}


def test_dion2_local_moves_a_fraction_of_it():
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  tx = _orthogonal(mesh, "dion2", fraction=0.25)
  got = _by_op(accounting.update_stats(tx, _params(mesh, LAYERS, D_IN, D_OUT), mesh))
  # The shorter side, fan_in = 256, is split over fs: each shard selects ceil(64/4) = 16 of
  # its 64 slices, each a (fan_out/tp = 512)-long bf16 vector, for every one of the 8 layers.
  selected = LAYERS * 16 * 512 * 2
  norms = LAYERS * 64 * 4  # The L1 norms of this shard's slices, float32, summed over tp.
  assert got == {
      ("all-to-all", ("fs",)): 2 * selected,
      ("all-to-all", ("tp",)): 2 * selected,
      ("all-reduce", ("tp",)): norms,
  }


def test_nordion2_moves_selected_neurons_and_their_norms():
  """NorDion2 selects output neurons, fan_out = 1024, split over tp; fan_in over fs."""
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  params = _params(mesh, LAYERS, D_IN, D_OUT)
  run = lambda scope: _by_op(accounting.update_stats(
      _orthogonal(mesh, "nordion2", fraction=0.25, selection_scope=scope), params, mesh))
  per_neuron = LAYERS * D_OUT // 2 * 4  # One float32 per local neuron and layer.
  # Each neuron's L1 norm and (after the polar factor) its mean square are psums over
  # fs; the block's two Frobenius norms one float per layer over fs and tp.
  sums = {("all-reduce", ("fs",)): 2 * per_neuron, ("all-reduce", ("fs", "tp")): 2 * LAYERS * 4}
  # local: each tp shard takes ceil(512/4) = 128 of its 512 neurons, (fan_in/fs = 64)-long
  # bf16 rows, gathered whole and sent back over fs and tp like Muon's blocks.
  selected = LAYERS * 128 * 64 * 2
  assert run("local") == {**sums, ("all-to-all", ("fs",)): 2 * selected, ("all-to-all", ("tp",)): 2 * selected}
  # global: the exact top ceil(1024/4) = 256 neurons of all norms (gathered over tp); each
  # tp shard adds its owned rows into the (256, 64) block of half the layers
  # (reduce-scatter), gathered over fs and back, and broadcast to both tp shards.
  block = LAYERS * 256 * 64 * 2
  assert run("global") == {**sums, ("reduce-scatter", ("tp",)): block, ("all-to-all", ("fs",)): block,
                           ("all-gather", ("tp",)): block + LAYERS * D_OUT * 4}


def test_ring_allreduce_and_full_gradient_bytes():
  mesh = dion_jax.make_mesh("fs=4,tp=2")
  assert accounting.full_gradient_bytes(_params(mesh, 2, 8, 16)) == 2 * 8 * 16 * 4
  assert accounting.ring_allreduce_bytes(1000, 4) == 1500
