"""``python -m benchmarks.gpu`` without a GPU, its profile summary on a synthetic trace, and
its MoE stage at a small size on CPU (so that a lent GPU's minutes do not find its bugs)."""

import argparse
import gzip
import json

import numpy as np

from benchmarks import gpu, gpu_moe


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


def test_moe_stage_runs_and_checks_the_grouped_product():
  assert gpu_moe.group_sizes(64, 4, skewed=False).tolist() == [16] * 4
  assert gpu_moe.group_sizes(64, 4, skewed=True).tolist() == [34, 10, 10, 10]
  # No time budget: the test checks the stage's results, not this machine's speed.
  out = gpu_moe.stage_moe(argparse.Namespace(stage_seconds=float("inf")), shapes=((64, 32, 16),), experts=(4,))
  assert out["complete"] and len(out["rows"]) == 2
  for row in out["rows"]:
    assert row["max_relative_error"] < 1e-2  # bfloat16 inputs, float32 reference
    assert np.isfinite(row["grouped_ms"]) and row["grouped_ms"] > 0
