"""``python -m benchmarks.comm_report``: the tables, on the repository's GPT and on the
fused-qkv set, and a bad mesh."""

from benchmarks import comm_report


def test_dion_report_per_rank_fraction(capsys):
  argv = ["--mesh", "fs=4,tp=2", "--layers", "2", "--d-model", "128", "--rank-fractions", "0.25"]
  assert comm_report.main(argv) == 0
  out = capsys.readouterr().out
  assert "| 0.25 | all |" in out and "| 0.25 | fs |" in out and "state bytes/device" in out


def test_family_report_beside_dion(capsys):
  argv = ["--optimizer", "muon", "--matrices", "gpt124m-fused", "--mesh", "fs=4,tp=2", "--layers", "2",
          "--d-model", "128"]
  assert comm_report.main(argv) == 0
  out = capsys.readouterr().out
  assert "| muon | all |" in out and "| dion (rank 1/4) | all |" in out


def test_family_report_with_replicas(capsys):
  # The family takes the replicas' mean gradient (no leading rp axis): this crashed once.
  argv = ["--optimizer", "muon", "--mesh", "rp=2,fs=2,tp=2", "--layers", "2", "--d-model", "128"]
  assert comm_report.main(argv) == 0
  out = capsys.readouterr().out
  assert "| muon | all |" in out and "| dion (rank 1/4) | with rp |" in out


def test_gpt_matrices_are_the_models_dion_kernels():
  shapes, specs = comm_report.gpt_matrices(layers=2, d_model=128, pp=1)
  names = {name.split("']['")[-2] for name in shapes}
  assert names == {"query", "key", "value", "out", "up", "down"}
  assert all(len(s) == 4 and s[:2] == (1, 2) for s in shapes.values())  # (stages, layers, fan_in, fan_out)


def test_bad_mesh_is_one_error_line(capsys):
  assert comm_report.main(["--mesh", "fs=3", "--layers", "2", "--d-model", "128"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error:") and err.count("\n") == 1
