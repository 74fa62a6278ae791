"""Tests for dion_jax.accounting.hlo: collective bytes and axes read from compiled HLO.

Expected bytes are computed by hand from the per-device shapes; expected axes
from the mesh layout. The mesh lays devices out in a shuffled order so that a
mix-up between Device.id and mesh position would show.
"""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dion_jax.accounting import hlo as comms
from dion_jax.parallel import make_mesh

F32_64x32 = 64 * 32 * 4  # bytes of one f32[64,32] block per device


@pytest.fixture(scope="module")
def mesh():
  devices = jax.devices()
  return make_mesh("rp=2,fs=2,tp=2", devices=[devices[i] for i in (3, 0, 6, 5, 1, 7, 2, 4)])


def _stats(mesh, f, in_specs, out_specs, *args, trip_counts=False):
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                            check_vma=False))
  stats = comms.collective_stats(g.lower(*args).compile(), mesh, trip_counts=trip_counts)
  return {(s.op, s.axes): (s.count, s.bytes) for s in stats}


def _x(rows, cols=32):
  return jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)


def test_mesh_positions_differ_from_device_ids(mesh):
  assert [d.id for d in mesh.devices.flat] != list(range(8))


def test_psum_over_rp(mesh):
  got = _stats(mesh, lambda a: lax.psum(a, "rp"), P("rp"), P(), _x(2 * 64))
  assert got == {("all-reduce", ("rp",)): (1, F32_64x32)}


def test_psum_over_fs_and_tp(mesh):
  got = _stats(mesh, lambda a: lax.psum(a, ("fs", "tp")), P(("fs", "tp")), P(), _x(4 * 64))
  assert got == {("all-reduce", ("fs", "tp")): (1, F32_64x32)}


def test_psum_over_rp_and_tp_skips_fs(mesh):
  got = _stats(mesh, lambda a: lax.psum(a, ("rp", "tp")), P(("rp", "tp")), P(), _x(4 * 64))
  assert got == {("all-reduce", ("rp", "tp")): (1, F32_64x32)}


def test_all_gather_over_tp_counts_output_bytes(mesh):
  got = _stats(mesh, lambda a: lax.all_gather(a, "tp", tiled=True), P("tp"), P(), _x(2 * 64))
  assert got == {("all-gather", ("tp",)): (1, 2 * F32_64x32)}


def test_ppermute_over_fs(mesh):
  got = _stats(mesh, lambda a: lax.ppermute(a, "fs", [(0, 1), (1, 0)]), P("fs"), P("fs"),
               _x(2 * 64))
  assert got == {("collective-permute", ("fs",)): (1, F32_64x32)}


def test_psum_scatter_over_fs_counts_operand_bytes(mesh):
  got = _stats(mesh, lambda a: lax.psum_scatter(a, "fs", tiled=True), P("rp"), P(("rp", "fs")),
               _x(2 * 64))
  assert got == {("reduce-scatter", ("fs",)): (1, F32_64x32)}


def test_all_to_all_over_tp(mesh):
  got = _stats(mesh, lambda a: lax.all_to_all(a, "tp", 0, 1, tiled=True), P("tp"), P("tp"),
               _x(2 * 64))
  assert got == {("all-to-all", ("tp",)): (1, F32_64x32)}


def test_mixed_dtypes_sum_their_bytes(mesh):
  def f(a):
    return lax.psum((a, a[:16].astype(jnp.int32)), "rp")
  got = _stats(mesh, f, P("rp"), (P(), P()), _x(2 * 64))
  assert set(got) == {("all-reduce", ("rp",))}
  count, nbytes = got["all-reduce", ("rp",)]
  assert count in (1, 2)  # XLA may or may not combine the two into one tuple all-reduce
  assert nbytes == 64 * 32 * 4 + 16 * 32 * 4


def test_combined_all_reduce_with_many_operands(mesh):
  # Seven operands: HLO marks the sixth with /*index=5*/ in shape and operand lists.
  def f(a):
    return lax.psum(tuple(a[:8 * (i + 1)] * i for i in range(7)), "rp")
  got = _stats(mesh, f, P("rp"), (P(),) * 7, _x(2 * 64))
  assert set(got) == {("all-reduce", ("rp",))}
  assert got["all-reduce", ("rp",)][1] == sum(8 * (i + 1) * 32 * 4 for i in range(7))


def test_loop_body_counts_once(mesh):
  def f(a):
    return lax.fori_loop(0, 3, lambda i, c: lax.psum(c, "rp") * 0.5, a)
  got = _stats(mesh, f, P("rp"), P(), _x(2 * 64))
  assert got == {("all-reduce", ("rp",)): (1, F32_64x32)}


def test_trip_counts_count_every_iteration_of_nested_loops(mesh):
  def f(a):
    inner = lambda i, c: lax.fori_loop(0, 2, lambda j, d: lax.psum(d, "tp") * 0.5, c)  # noqa: E731
    return lax.psum(lax.fori_loop(0, 3, inner, a), "rp")
  got = _stats(mesh, f, P("rp"), P(), _x(2 * 64), trip_counts=True)
  assert got == {("all-reduce", ("rp",)): (1, F32_64x32), ("all-reduce", ("tp",)): (6, 6 * F32_64x32)}


def test_trip_counts_of_a_loop_of_unknown_length_raise(mesh):
  def f(a):
    return lax.while_loop(lambda c: c[0, 0] < 100.0, lambda c: lax.psum(c, "rp") + 1.0, a)
  with pytest.raises(ValueError, match="no known trip count"):
    _stats(mesh, f, P("rp"), P(), _x(2 * 64), trip_counts=True)


def test_both_branches_of_a_conditional_count(mesh):
  def f(a):
    return lax.cond(a[0, 0] > 0, lambda c: lax.psum(c, "rp"), lambda c: lax.psum(c, "tp"), a)
  got = _stats(mesh, f, P(), P(), _x(64))
  assert got == {("all-reduce", ("rp",)): (1, F32_64x32), ("all-reduce", ("tp",)): (1, F32_64x32)}


def test_automatic_sharding_collectives(mesh):
  # x is (128, 64) with rows over (rp, tp) and columns over fs: each device sums
  # its 32 rows of 32 columns, then the partial sums f32[32] are added over rp, tp.
  g = jax.jit(lambda a: a.sum(0), in_shardings=NamedSharding(mesh, P(("rp", "tp"), "fs")))
  lowered = g.lower(_x(128, 64))
  stats = comms.collective_stats(lowered, mesh)  # a Lowered is compiled first
  # A group of 4: a ring all-reduce sends 2·3/4 of the payload.
  assert stats == [comms.CollectiveStat("all-reduce", ("rp", "tp"), 1, 32 * 4, 192)]


def test_partial_manual_shard_map(mesh):
  # Manual over rp only: the contraction over the fs-sharded columns is summed by
  # XLA over fs, then the explicit psum sums the f32[64,64] result over rp.
  def f(a):
    return lax.psum(a @ a.T, "rp")
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("rp"), out_specs=P(), axis_names={"rp"},
                            check_vma=False),
              in_shardings=NamedSharding(mesh, P("rp", "fs")))
  stats = comms.collective_stats(g.lower(_x(128, 64)).compile(), mesh)
  assert comms.bytes_by_axes(stats) == {("rp",): 64 * 64 * 4, ("fs",): 64 * 64 * 4}


# --- Synthetic HLO: formats the CPU backend does not emit --------------------------

_ASYNC_HLO = """\
HloModule m, is_scheduled=true, num_partitions=8

ENTRY %main (p0: f32[64,32], p1: bf16[16]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = bf16[16]{0} parameter(1)
  %ars = f32[64,32]{1,0} all-reduce-start(%p0), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(0,2,1), use_global_device_ids=true, to_apply=%add
  %ard = f32[64,32]{1,0} all-reduce-done(%ars)
  %ags = (bf16[16]{0}, bf16[64]{0}) all-gather-start(%p1), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = bf16[64]{0} all-gather-done(%ags)
  %cps = (f32[64,32]{1,0}, f32[64,32]{1,0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  ROOT %cpd = f32[64,32]{1,0} collective-permute-done(%cps)
}
"""


_WRAPPED_HLO = """\
HloModule m, num_partitions=8

%wrapped_reduce_scatter (param_0: f32[64,32]) -> f32[32,32] {
  %param_0 = f32[64,32]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[32,32]{1,0} reduce-scatter(%param_0), channel_id=1, replica_groups={{0,2},{1,3},{4,6},{5,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[64,32]) -> f32[32,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %rs-start = ((f32[64,32]{1,0}), f32[32,32]{1,0}) async-start(%p0), calls=%wrapped_reduce_scatter
  ROOT %rs-done = f32[32,32]{1,0} async-done(%rs-start)
}
"""


@pytest.fixture(scope="module")
def plain_mesh():
  return make_mesh("rp=2,fs=2,tp=2")


def test_async_pairs_count_once(plain_mesh):
  stats = comms.collective_stats(_ASYNC_HLO, plain_mesh)
  assert stats == [
      comms.CollectiveStat("all-reduce", ("fs",), 1, F32_64x32, F32_64x32),  # groups {0,2},{1,3},...
      comms.CollectiveStat("all-gather", ("fs", "tp"), 1, 64 * 2, 64 * 2 * 3 // 4),  # bf16[64] gathered
      comms.CollectiveStat("collective-permute", ("rp",), 1, F32_64x32, F32_64x32),
  ]


def test_async_wrapped_collective_counts_once(plain_mesh):
  assert comms.collective_stats(_WRAPPED_HLO, plain_mesh) == [
      comms.CollectiveStat("reduce-scatter", ("fs",), 1, F32_64x32, F32_64x32 // 2)]


def _one(op_line: str, mesh, defs: str = "  %p = f32[64,32]{1,0} parameter(0)\n"):
  hlo = f"HloModule m\n\nENTRY %main {{\n{defs}  ROOT %c = {op_line}\n}}\n"
  return comms.collective_stats(hlo, mesh)


@pytest.mark.parametrize("groups, axes", [
    ("{{0,1},{2,3},{4,5},{6,7}}", ("tp",)),
    ("{{0,4},{1,5},{2,6},{3,7}}", ("rp",)),
    ("{}", ("rp", "fs", "tp")),
    ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    ("[2,4]<=[8]", ("fs", "tp")),
    ("[4,2]<=[2,4]T(1,0)", ("rp",)),
    ("mesh['a'=8] {'a'}", ("rp", "fs", "tp")),
    ("mesh['a'=8] {'a':(1)2}", ("rp",)),
    ("mesh['a'=8] {'a':(2)2}", ("fs",)),
    ("mesh['a'=8] {'a':(4)2}", ("tp",)),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ("rp", "tp")),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}", ("rp", "tp")),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_1'}", ("fs",)),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_0'}", ("rp", "tp")),
    ("mesh['x'=2,'y'=4], device_ids=(0,2,4,6,1,3,5,7) {'y'}", ("rp", "fs")),
])
def test_replica_group_formats(plain_mesh, groups, axes):
  line = f"f32[64,32]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, to_apply=%add"
  group = 2 ** len(axes)  # every axis of plain_mesh has size 2
  wire = 2 * F32_64x32 * (group - 1) // group
  assert _one(line, plain_mesh) == [comms.CollectiveStat("all-reduce", axes, 1, F32_64x32, wire)]


def test_operands_printed_with_shapes_and_tuples(plain_mesh):
  line = ("(f32[64,32]{1,0}, bf16[10]{0}, pred[3]{0}) all-reduce(f32[64,32]{1,0} %p, "
          "bf16[10]{0} %q, pred[3]{0} %r), replica_groups={{0,1},{2,3},{4,5},{6,7}}")
  assert _one(line, plain_mesh) == [
      comms.CollectiveStat("all-reduce", ("tp",), 1, F32_64x32 + 10 * 2 + 3, F32_64x32 + 10 * 2 + 3)]


@pytest.mark.parametrize("shape, nbytes", [
    ("f32[64,32]{1,0}", 8192), ("bf16[8,4]", 64), ("pred[10]", 10), ("s32[]", 4),
    ("(f32[2,2]{1,0}, s8[3])", 19), ("f8e4m3fn[16]", 16), ("s4[3]", 2), ("f32[<=5,2]", 40),
    ("c64[2]", 16), ("u16[3,0]", 0),
])
def test_shape_bytes(shape, nbytes):
  assert comms.shape_bytes(shape) == nbytes


@pytest.mark.parametrize("line, pattern", [
    ("f32[64,32]{1,0} all-reduce(%p), replica_groups=groups(a,b)", "unrecognised replica_groups"),
    ("f32[64,32]{1,0} all-reduce(%p), replica_groups=mesh['a'=8] {'b'}", "unrecognised axis"),
    ("f32[64,32]{1,0} all-reduce(%p), to_apply=%add", "without replica_groups"),
    ("f32[64,32]{1,0} all-reduce(%p), replica_groups={{0,8}}", "outside the mesh of 8"),
    ("f32[64,32]{1,0} all-reduce(%zz), replica_groups={{0,1}}", "'%zz' .* is not defined"),
    ("q9[4] all-reduce(%p), replica_groups={{0,1}}", "unknown HLO element type 'q9'"),
    ("f32[64,32]{1,0} collective-permute(%p), channel_id=1", "without source_target_pairs"),
])
def test_unreadable_hlo_raises(plain_mesh, line, pattern):
  with pytest.raises(ValueError, match=pattern):
    _one(line, plain_mesh, defs="  %p = q9[4] parameter(0)\n" if line.startswith("q9") else
         "  %p = f32[64,32]{1,0} parameter(0)\n")


def test_module_for_another_mesh_raises(plain_mesh):
  with pytest.raises(ValueError, match="num_partitions=4 but the mesh has 8 devices"):
    comms.collective_stats("HloModule m, num_partitions=4\n", plain_mesh)


def test_bytes_by_axes_and_table():
  stats = [comms.CollectiveStat("all-reduce", ("rp",), 2, 100),
           comms.CollectiveStat("all-gather", ("rp",), 1, 50),
           comms.CollectiveStat("collective-permute", (), 1, 7)]
  assert comms.bytes_by_axes(stats) == {("rp",): 150, (): 7}
  table = comms.format_table(stats).splitlines()
  assert table[0].split() == ["op", "axes", "count", "bytes"]
  assert table[1].split() == ["all-reduce", "rp", "2", "100"]
  assert table[3].split() == ["collective-permute", "-", "1", "7"]
  assert table[-1].split() == ["total", "4", "157"]
