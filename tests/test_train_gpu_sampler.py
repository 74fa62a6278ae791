"""The ``sampler`` stage of ``python -m train.gpu`` on CPU, on ``tiny`` with a tiny batch:
our decode's tokens/s, transformers' on torch's CPU where it is installed, and one line
where it is not."""

import argparse
import math
import sys

import numpy as np
import pytest

import models
from train.gpu import sampler


def test_stage_reports_our_tokens_per_second_and_one_line_without_torch(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # as without torch
  record = sampler.stage_sampler(argparse.Namespace(stage_seconds=math.inf), preset="tiny", batch=2, prompt=8,
                                 new_tokens=4)
  ours, theirs = record["rows"]
  assert record["complete"] and ours["case"].startswith("models.generate")
  assert ours["seconds"] > 0 and ours["tokens_per_s"] == 2 * 4 / ours["seconds"]
  assert theirs == {"case": "transformers generate", "skipped": sampler.SKIP}
  table = sampler.markdown(record)
  assert table.count(sampler.SKIP) == 1 and "| models.generate" in table


def test_transformers_generate_on_a_gpt2_of_our_shape():
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  cfg = models.preset("tiny", dtype="bfloat16")
  prompts_BxP = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
  row = sampler.transformers_generate(cfg, prompts_BxP, new_tokens=3, device="cpu")
  assert row["case"].startswith("transformers ") and "bfloat16, cpu" in row["case"]
  assert row["seconds"] > 0 and row["tokens_per_s"] == 2 * 3 / row["seconds"]


def test_no_case_starts_after_the_deadline():
  record = sampler.stage_sampler(argparse.Namespace(stage_seconds=-1.0), preset="tiny", batch=2, prompt=8, new_tokens=4)
  assert record["rows"] == [] and not record["complete"]
