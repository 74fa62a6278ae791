"""Dion's measured communication: (m + n)·r values per matrix over rp instead of m·n."""

import jax

from dion_jax import comm_report
from dion_jax import mesh as mesh_lib


def _square_set(layers=2, d=256):
  col = mesh_lib.column_parallel()
  return comm_report.MatrixSet({"w": (layers, d, d)}, {"w": mesh_lib.stacked(col)})


def test_compressed_sync_moves_m_plus_n_times_r_over_rp():
  mesh = mesh_lib.make_mesh("rp=2", jax.devices()[:2])
  layers, d, r = 1, 256, 64
  stats = comm_report.dion_step_stats(mesh, _square_set(layers, d), rank_fraction=0.25)
  over_rp = sum(s.bytes for s in stats if "rp" in s.axes)
  expected = layers * (d + d) * r * 4
  assert abs(over_rp - expected) <= 0.02 * expected
  # A single all-reduce of the m x n gradient over rp would alone exceed all of it.
  assert over_rp < d * d * 4


def test_uncompressed_matrices_average_their_gradient():
  mesh = mesh_lib.make_mesh("rp=2", jax.devices()[:2])
  stats = comm_report.dion_step_stats(mesh, _square_set(2, 128), rank_fraction=1.0)
  over_rp = sum(s.bytes for s in stats if s.axes == ("rp",))
  assert over_rp >= 2 * 128 * 128 * 4  # The whole gradient of both layers.


def test_state_bytes_split_over_fs_and_tp():
  mesh = mesh_lib.make_mesh("fs=4,tp=2")
  local, single = comm_report.state_bytes_per_device(mesh, _square_set(2, 256), 0.25)
  m_bytes, q_bytes = 2 * 256 * 256 * 4, 2 * 256 * 64 * 4
  assert single == m_bytes + q_bytes
  assert local == m_bytes // 8 + q_bytes // 4  # M over fs x tp; Q's rows over fs.


def test_cli_reports_and_rejects_bad_mesh(capsys):
  assert comm_report.main(["--mesh", "fs=4,tp=2", "--layers", "2", "--d-model", "128", "--rank-fractions", "0.25"]) == 0
  assert "| 0.25 | all |" in capsys.readouterr().out
  assert comm_report.main(["--mesh", "fs=3", "--layers", "2", "--d-model", "128"]) == 2
  assert "error:" in capsys.readouterr().err
