"""Muon's and Dion2's measured communication against bytes counted by hand."""

import jax

from dion_jax import comm_report
from dion_jax import family_comm
from dion_jax import mesh as mesh_lib

LAYERS, D_IN, D_OUT = 8, 256, 1024  # A stacked column-parallel kernel, Flax layout.


def _one_kernel():
  return comm_report.MatrixSet({"w": (LAYERS, D_IN, D_OUT)}, {"w": mesh_lib.stacked(mesh_lib.column_parallel())})


def _by_op(stats):
  out = {}
  for s in stats:
    out[(s.op, s.axes)] = out.get((s.op, s.axes), 0) + s.bytes
  return out


def test_muon_moves_each_block_four_times_in_bf16_never_gathers():
  mesh = mesh_lib.make_mesh("fs=4,tp=2")
  got = _by_op(family_comm.family_step_stats(mesh, _one_kernel(), "muon"))
  block = LAYERS * D_IN * D_OUT // 8 * 2  # This device's bf16 block of the stack.
  # Over fs: (8, 64, 512) -> (2, 256, 512) and back; over tp: (2, 256, 512) -> (1, 256, 1024) and back.
  assert got == {("all-to-all", ("fs",)): 2 * block, ("all-to-all", ("tp",)): 2 * block}


def test_dion2_local_moves_a_fraction_of_it():
  mesh = mesh_lib.make_mesh("fs=4,tp=2")
  got = _by_op(family_comm.family_step_stats(mesh, _one_kernel(), "dion2", fraction=0.25))
  # The shorter side, fan_in = 256, is split over fs: each shard selects ceil(64/4) = 16 of
  # its 64 slices, each a (fan_out/tp = 512)-long bf16 vector, for every one of the 8 layers.
  selected = LAYERS * 16 * 512 * 2
  norms = LAYERS * 64 * 4  # The L1 norms of this shard's slices, float32, summed over tp.
  assert got == {
      ("all-to-all", ("fs",)): 2 * selected,
      ("all-to-all", ("tp",)): 2 * selected,
      ("all-reduce", ("tp",)): norms,
  }


def test_cli_family_report(capsys):
  assert comm_report.main(["--optimizer", "muon", "--mesh", "fs=4,tp=2", "--layers", "2", "--d-model", "128"]) == 0
  out = capsys.readouterr().out
  assert "| muon | all |" in out and "| dion (rank 1/4) | all |" in out
