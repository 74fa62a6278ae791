"""``python -m train.gpu`` without a GPU, its profile summary on a synthetic trace, its MoE,
train and profile stages at a small size on CPU (so that a lent GPU's minutes do not find
their bugs)."""

import argparse
import gzip
import json

import numpy as np

from tests.test_train_store_profiling import annotated_steps
from train.gpu import __main__ as gpu_cmd
from train.gpu import evidence as gpu
from train.gpu import moe as gpu_moe


def test_without_a_gpu_one_line_and_exit_2(capsys):
  assert gpu_cmd.main([]) == gpu_cmd.EXIT_NO_GPU
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


def test_train_stage_reports_the_optimizers_share_of_the_step(tmp_path):
  # tiny on CPU, so that the stage's code runs before a GPU's minutes are spent on it.
  args = argparse.Namespace(stage_seconds=float("inf"), train_steps=2)
  out = gpu.stage_train(args, runs=(("tiny", 8, ("adamw",)),), attention="xla")
  assert out["complete"] and [r["optimizer"] for r in out["rows"]] == ["adamw"]
  for row in out["rows"]:
    assert row["preset"] == "tiny" and row["ms_per_step"] > 0 and row["optimizer_ms"] > 0
    assert row["optimizer_share"] == row["optimizer_ms"] / row["ms_per_step"]
    assert "% of the step)" in gpu.train_line(row)
  gpu.plot({"device": "cpu", "train": out}, str(tmp_path / "gpu.png"))
  assert (tmp_path / "gpu.png").stat().st_size > 0


def test_profile_stage_summarizes_the_trainers_own_trace(monkeypatch):
  """The stage's trace is the one ``--profile-steps 2:6`` makes (tiny on CPU, whose trace
  has no device kernels to summarize)."""
  seen = []
  monkeypatch.setattr(gpu, "summarize_trace", lambda path: seen.append(annotated_steps(path)) or [])
  out = gpu.stage_profile(argparse.Namespace(), preset="tiny", batch=8, attention="xla")
  assert out["steps"] == "2:6" and seen == [[2, 3, 4, 5, 6]]
