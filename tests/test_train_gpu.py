"""``python -m train.gpu`` without a GPU, its wiring with the GPU faked, its profile summary
on a synthetic trace, its MoE, train and profile stages at a small size on CPU (so that a
lent GPU's minutes do not find their bugs)."""

import argparse
import gzip
import json

import numpy as np
import pytest

from tests.test_train_store_profiling import annotated_steps
from train.gpu import __main__ as gpu_cmd
from train.gpu import evidence as gpu
from train.gpu import moe as gpu_moe
from train.gpu import optimizers as gpu_optimizers
from train.gpu import sampler as gpu_sampler


def test_without_a_gpu_one_line_and_exit_2(capsys):
  assert gpu_cmd.main([]) == gpu_cmd.EXIT_NO_GPU
  err = capsys.readouterr().err
  assert err.startswith("error: no GPU") and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--stages", "foo"], "--stages foo: unknown 'foo'; choose from check,"),  # was argparse's usage and a second line
    (["--stages", "check,,train"], "--stages check,,train: unknown ''; choose from check,"),  # was 'unknown ;'
    (["--stage-seconds", "x"], "argument --stage-seconds: invalid float value: 'x' (see python -m train.gpu --help)"),
    (["--train-steps", "0"], "--train-steps must be positive, got 0"),
    (["--out", "{file}"], "is a file, not a folder"),  # was FileExistsError on a GPU, after the GPU check
])
def test_bad_flags_one_line_and_exit_2_before_the_gpu_check(capsys, tmp_path, argv, message):
  (tmp_path / "file").write_text("")
  assert gpu_cmd.main([a.format(file=tmp_path / "file") for a in argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


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
  # tiny on CPU, so that the stage's code runs before a GPU's minutes are spent on it;
  # with --fp8 and --fp8 delayed, as its FP8 rows run (tests/test_train_run_cuda_lowering.py
  # lowers both for CUDA).
  args = argparse.Namespace(stage_seconds=float("inf"), train_steps=2)
  out = gpu.stage_train(args, runs=(("tiny", 8, ("adamw fp8", "adamw fp8 delayed")),), attention="xla")
  assert out["complete"] and [(r["optimizer"], r["fp8"]) for r in out["rows"]] == [
      ("adamw fp8", "current"), ("adamw fp8 delayed", "delayed")]
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


def test_each_stage_with_a_table_writes_it_beside_the_json(monkeypatch, tmp_path):
  """The command's wiring, the GPU faked and the stages stubbed: gpu.json, each stage's
  markdown table and the figure (its small's-set panel included)."""
  rows = gpu_optimizers.add_muon_ratio([gpu_optimizers.rate_row("muon", "dion_jax", 0.005, 10**12),
                                        gpu_optimizers.rate_row("muon", "microsoft/dion", 0.007, 10**12)])
  records = {"optimizers": {"set": {"preset": "small", "matrices": 72, "shapes": {"768x768": 48}, "rows": rows,
                                    "reference": "stub", "timing": "mean"}, "rows": []},
             "sampler": {"preset": "small", "batch": 64, "prompt": 128, "new_tokens": 256, "rows": [
                 {"case": "models.generate", "first_call_s": 9.0, "seconds": 1.0, "tokens_per_s": 16384.0}]}}
  monkeypatch.setattr(gpu_cmd.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(gpu_optimizers, "stage_optimizers", lambda args: dict(records["optimizers"]))
  monkeypatch.setattr(gpu_sampler, "stage_sampler", lambda args: dict(records["sampler"]))
  assert gpu_cmd.main(["--stages", "optimizers,sampler", "--out", str(tmp_path)]) == 0
  saved = json.loads((tmp_path / "gpu.json").read_text())
  assert saved["optimizers"]["set"]["rows"] == rows and saved["sampler"]["rows"][0]["tokens_per_s"] == 16384.0
  assert (tmp_path / "optimizers.md").read_text() == gpu_optimizers.markdown(records["optimizers"]) + "\n"
  assert (tmp_path / "sampler.md").read_text() == gpu_sampler.markdown(records["sampler"]) + "\n"
  assert (tmp_path / "gpu.png").stat().st_size > 0


def test_train_stage_runs_a_variant_as_its_optimizer_with_its_flags(monkeypatch):
  """"dion tf32x3" trains ``--optimizer dion --dion-qr-precision tensorfloat32x3`` and is
  reported under its own name; every variant's flags are fields the trainer's Config checks."""
  from train.run import config as config_lib

  seen = []

  def fake_run(preset, optimizer, steps, batch, attention, optimizer_steps=0, overrides=None):
    seen.append((optimizer, overrides))
    return {"preset": preset, "optimizer": optimizer, "ms_per_step": 1.0, "tokens_per_s": 1.0, "tflops": 1.0,
            "mfu": None, "process_peak_memory_GiB": 0.0}

  monkeypatch.setattr(gpu, "train_run", fake_run)
  args = argparse.Namespace(stage_seconds=float("inf"), train_steps=2)
  out = gpu.stage_train(args, runs=(("tiny", 8, ("dion", "dion tf32x3")),), attention="xla")
  assert seen == [("dion", {}), ("dion", {"dion_qr_precision": "tensorfloat32x3"})]
  assert [r["optimizer"] for r in out["rows"]] == ["dion", "dion tf32x3"]
  for optimizer, overrides in gpu.VARIANTS.values():
    config_lib.Config(preset="tiny", optimizer=optimizer, **overrides).check()
