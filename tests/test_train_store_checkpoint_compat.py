"""Checkpoints written by an earlier dion_jax still restore: the saved optimizer-state layout.

``tests/fixtures/checkpoints/{dion,normuon,muon,dion2}`` are run directories written by
``python -m train.gpt`` at commit 1d16583, before the package redesign of issue 20 (see
``tests/fixtures/checkpoints/README.md`` for the commands). Each holds one checkpoint at
step 2 of a 1-layer GPT trained on mesh rp=2, and ``expected_step{3,4}.json``: the training
records of steps 3 and 4 of the same run trained without interruption.

Resuming must reproduce them. The step-3 loss depends only on the restored parameters and
data position; the step-4 loss also depends on the restored optimizer state (momentum, Q,
Adam moments, the update count), which step 3's update reads: restarting from fresh
optimizer state moves it by about 2.4%. So a redesign that renames, reorders or reshapes
the optimizer-state fields must keep (or convert) what these checkpoints hold.

The runs trained on the default corpus, the standard library of the Python that ran them
(3.11): another Python's library is other text, so the comparisons of losses run on 3.11.
"""
import json
import pathlib
import shutil
import sys

import pytest

from train import gpt

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "checkpoints"
OPTIMIZERS = ("dion", "normuon", "muon", "dion2")
same_corpus = pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="the fixtures trained on Python 3.11's standard library (the default corpus); this Python's is other text")


def _resume(tmp_path, optimizer: str, *flags: str) -> dict[int, dict]:
  """Resume a copy of the fixture to step 4; the training records by step."""
  run_dir = tmp_path / optimizer
  shutil.copytree(FIXTURES / optimizer, run_dir)
  assert gpt.main(["--resume", "--run-dir", str(run_dir), "--steps", "4", *flags]) == 0
  with open(run_dir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r for r in records if "loss" in r}


def _expected(optimizer: str, step: int) -> dict:
  with open(FIXTURES / optimizer / f"expected_step{step}.json") as f:
    return json.load(f)


@same_corpus
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_saved_optimizer_state_restores(tmp_path, optimizer):
  """A checkpoint saved before the redesign resumes on the same mesh (rp=2) and continues
  as the uninterrupted run did: guards the saved optimizer-state layout across the redesign
  of issue 20 (step 4 depends on the restored optimizer state)."""
  got = _resume(tmp_path, optimizer)
  assert sorted(got) == [3, 4]
  for step in (3, 4):
    want = _expected(optimizer, step)
    for key in ("loss", "grad_norm"):
      assert got[step][key] == pytest.approx(want[key], rel=1e-6), (step, key)


@same_corpus
def test_saved_dion_state_restores_onto_another_mesh_and_in_float16(tmp_path):
  """The Dion checkpoint saved on rp=2 resumes on fs=2 (its per-replica momentum averaged
  into one replica, the rest resharded), and in float16: guards the saved layout's mesh
  independence across the redesign of issue 20. The fixtures predate the loss scale (issue
  19): the run takes the fresh scale (--initial-loss-scale) and every other array as saved
  (measured: steps 3 and 4 within 1.5e-5 of the uninterrupted float32 run on rp=2)."""
  got = _resume(tmp_path, "dion", "--mesh", "fs=2", "--dtype", "float16", "--initial-loss-scale", "1024")
  assert sorted(got) == [3, 4]
  for step in (3, 4):
    want = _expected("dion", step)
    assert got[step]["loss_scale"] == 1024.0 and got[step]["skipped"] == 0
    assert got[step]["loss"] == pytest.approx(want["loss"], rel=1e-4), step


def test_only_the_loss_scale_may_be_missing(tmp_path, capsys):
  """Any other array the checkpoint lacks is an error: Lion's scalar state is not there."""
  run_dir = tmp_path / "dion"
  shutil.copytree(FIXTURES / "dion", run_dir)
  assert gpt.main(["--resume", "--run-dir", str(run_dir), "--steps", "4",
                   "--dion-scalar-optimizer", "lion"]) == 2
  assert "lion/inner_state/0/mu/blocks/attn_norm/scale has shape None" in capsys.readouterr().err
