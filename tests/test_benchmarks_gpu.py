"""``python -m benchmarks.gpu`` without a GPU, and its profile summary on a synthetic trace."""

import gzip
import json

from benchmarks import gpu


def test_without_a_gpu_one_line_and_exit_2(capsys):
  assert gpu.main([]) == gpu.EXIT_NO_GPU
  err = capsys.readouterr().err
  assert err.startswith("error: no GPU") and err.count("\n") == 1


def test_profile_summary_counts_device_kernels_only(tmp_path):
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "name": "geqr2_batch_kernel", "dur": 3000},
      {"ph": "X", "pid": 1, "name": "gemm", "dur": 500},
      {"ph": "X", "pid": 1, "name": "gemm", "dur": 500},
      {"ph": "X", "pid": 2, "name": "host work", "dur": 99999},
  ]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  rows = gpu.summarize_trace(str(path))
  assert [(r["kernel"], r["ms"], r["count"]) for r in rows] == [("geqr2_batch_kernel", 3.0, 1), ("gemm", 1.0, 2)]
  assert abs(rows[0]["share"] - 0.75) < 1e-12
