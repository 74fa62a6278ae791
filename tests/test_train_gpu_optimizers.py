"""The ``optimizers`` stage of ``python -m train.gpu`` on CPU: ``small``'s matrix set read
from the model against issue 44's description of it, its flop counts against docs/design.md
§4's table, the rate arithmetic, and the stage itself on ``tiny``'s set (so that a lent
GPU's minutes do not find its bugs)."""

import argparse
import collections
import math
import sys
from unittest import mock

import jax
import numpy as np

from train.gpu import optimizers, reference

# Issue 44: "the 72 matrices of `small` (12 layers x [four 768x768, 3072x768, 768x3072])".
ISSUE_SET = {(768, 768): 4 * 12, (3072, 768): 12, (768, 3072): 12}
# docs/design.md §4, total GFLOP per step on small's set, as a GPU resolves qr_method="auto".
DESIGN_GFLOP = {"dion r=1": 1826.4, "dion r=1/2": 554.5, "dion r=1/4": 203.7, "dion r=1/2 polar": 546.3,
                "muon": 1630.7, "dion2 1/4": 86.6, "optax adamw": 1.3}
CASES = {c.name: c for c in optimizers.CASES}


def test_small_set_is_the_issues_72_matrices_as_the_model_stacks_them():
  abstract = optimizers.matrix_set("small")
  assert sorted(abstract) == [f"blocks/attn/{n}/kernel" for n in ("key", "out", "query", "value")] + [
      "blocks/mlp/down/kernel", "blocks/mlp/up/kernel"]
  assert all(a.shape[:2] == (1, 12) for a in abstract.values())  # [stages, layers, m, n]
  shapes = optimizers.matrix_shapes(abstract)
  assert len(shapes) == 72 and collections.Counter(shapes) == ISSUE_SET


def test_flops_are_the_design_tables_on_a_gpu():
  shapes = optimizers.matrix_shapes(optimizers.matrix_set("small"))
  with mock.patch.object(jax, "default_backend", lambda: "gpu"):  # "auto" is shifted_cqr there
    got = {name: round(CASES[name].flops(shapes) / 1e9, 1) for name in DESIGN_GFLOP}
  assert got == DESIGN_GFLOP
  # Elsewhere "auto" is rcqr (the design table's rcqr row); bf16 products count the same flops.
  assert round(CASES["dion r=1/2"].flops(shapes) / 1e9, 1) == 414.5
  assert CASES["dion r=1/2 bf16 power"].flops(shapes) == CASES["dion r=1/2"].flops(shapes)
  # TF32x3 passes count their logical multiply-adds, as float32 ones do: the rates compare.
  for rank in ("1/2", "1/4"):
    assert CASES[f"dion r={rank} tf32x3 passes"].flops(shapes) == CASES[f"dion r={rank}"].flops(shapes)


def test_rate_row_and_muon_ratio():
  row = optimizers.rate_row("dion r=1/2", "dion_jax", seconds=0.004, flops=3 * 10**11)
  assert row == {"optimizer": "dion r=1/2", "implementation": "dion_jax", "ms": 4.0, "gflop": 300.0, "tflops": 75.0}
  rows = optimizers.add_muon_ratio([
      row, optimizers.rate_row("muon", "dion_jax", 0.002, 10**12),
      optimizers.rate_row("muon", "microsoft/dion", 0.008, 10**12),
      optimizers.rate_row("dion r=1/2", "microsoft/dion", 0.016, 10**11),
      {"optimizer": "dion r=1", "implementation": "dion_jax", "error": "boom"}])
  assert [r.get("vs_muon") for r in rows] == [2.0, 1.0, 1.0, 2.0, None]


def test_stage_on_tiny_times_each_case_and_says_why_the_reference_is_missing(monkeypatch):
  monkeypatch.setitem(sys.modules, "dion", None)  # microsoft/dion not importable
  cases = [CASES[name] for name in ("dion r=1/2", "muon", "optax adamw")]
  # No time budget: the test checks the stage's results, not this machine's speed; no sweep.
  record = optimizers.stage_optimizers(argparse.Namespace(stage_seconds=math.inf, max_size=0), "tiny", cases)
  small = record["set"]
  assert small["matrices"] == 24 and small["shapes"] == {"128x128": 16, "128x512": 4, "512x128": 4}
  assert [r["optimizer"] for r in small["rows"]] == [c.name for c in cases]
  shapes = optimizers.matrix_shapes(optimizers.matrix_set("tiny"))
  for case, row in zip(cases, small["rows"]):
    assert np.isfinite(row["ms"]) and row["ms"] > 0
    assert row["gflop"] == case.flops(shapes) / 1e9
    assert math.isclose(row["tflops"], row["gflop"] / row["ms"])  # 1e9 / 1e-3 / 1e12
  assert small["rows"][1]["vs_muon"] == 1.0
  assert small["reference"] == reference.SKIP and record["rows"] == []
  table = optimizers.markdown(record)
  assert table.count("skipped") == 1 and f"microsoft/dion: {reference.SKIP}" in table
  assert "| muon | " in table


def test_a_failing_case_is_a_row_and_the_next_still_runs():
  broken = optimizers.Case("dion bad", "dion", {"qr_method": "no such method"})
  rows = optimizers.time_set(optimizers.matrix_set("tiny"), (broken, CASES["optax adamw"]), steps=1, warmup=1)
  assert "error" in rows[0] and rows[1]["optimizer"] == "optax adamw" and rows[1]["ms"] > 0


def test_markdown_puts_both_implementations_side_by_side():
  rows = optimizers.add_muon_ratio([optimizers.rate_row("muon", "dion_jax", 0.005, 10**12),
                                    optimizers.rate_row("muon", "microsoft/dion", 0.007, 10**12)])
  record = {"set": {"preset": "small", "matrices": 72, "shapes": {"768x768": 48}, "rows": rows,
                    "reference": "microsoft/dion on torch", "timing": "mean"},
            "rows": [{"n": 2048, "muon": 1.5, "dion r=1": "out of memory"}]}
  lines = optimizers.markdown(record).splitlines()
  assert "| muon | 5.00 | 1,000.0 | 200.0 | 1.00x | 7.00 | 1,000.0 | 142.9 | 1.00x |" in lines
  assert "| 2048 | out of memory | 1.50 |" in lines
