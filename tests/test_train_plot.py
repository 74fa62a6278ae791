"""python -m train.plot: the PNG of a real run's curves, resumed runs (train.store.log.read_metrics), bad input."""
import json
import os
import shutil

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest

from train import gpt, plot
from train.store import log

RUN = ["--steps", "4", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
       "--seq-len", "16", "--global-batch-size", "4", "--save-every", "2", "--eval-every", "2",
       "--eval-tokens", "64", "--log-interval", "1", "--mesh", "fs=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A real 4-step run, and a copy of it named ``other`` with its losses raised by 0.5."""
  root = tmp_path_factory.mktemp("plot")
  run = str(root / "tiny-dion")
  assert gpt.main([*RUN, "--run-dir", run]) == 0
  other = str(root / "other")
  shutil.copytree(run, other, ignore=shutil.ignore_patterns("checkpoints"))
  with open(os.path.join(run, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  with open(os.path.join(other, "metrics.jsonl"), "w") as f:
    for r in records:
      f.write(json.dumps({k: v + 0.5 if k in ("loss", "val_loss") else v for k, v in r.items()}) + "\n")
  return run, other


def _pixels_near(image_HxWx4, colour: str) -> int:
  rgb = np.asarray(matplotlib.colors.to_rgb(colour))
  return int(np.sum(np.abs(image_HxWx4[..., :3] - rgb).max(-1) < 0.05))


def test_png_has_one_colour_per_run(runs, tmp_path, capsys):
  output = str(tmp_path / "curves.png")
  assert plot.main([*runs, "--output", output]) == 0
  assert capsys.readouterr().out == f"wrote {output}\n"
  image_HxWx4 = matplotlib.image.imread(output)
  width, height = (int(s * plot.DPI) for s in plot.FIGSIZE)
  assert image_HxWx4.shape == (height, width, 4)
  # Each run's lines in its own colour (C0, C1), over a white figure; C2 is unused.
  assert _pixels_near(image_HxWx4, "C0") > 200 and _pixels_near(image_HxWx4, "C1") > 200
  assert _pixels_near(image_HxWx4, "C2") == 0
  assert _pixels_near(image_HxWx4, "white") > width * height // 2


def test_curves_of_the_run(runs):
  train, valid = plot.read_curves(runs[0])
  assert sorted(train) == [1, 2, 3, 4] and sorted(valid) == [2, 4]
  assert [train[s][0] for s in sorted(train)] == [64, 128, 192, 256]  # tokens: step x 4 x 16
  assert plot.label(runs[0]) == "tiny-dion" and plot.label(runs[1]) == "other (dion)"


def test_a_resumed_runs_later_records_win(tmp_path):
  lines = [{"step": 1, "tokens": 10, "loss": 5.0}, {"step": 2, "tokens": 20, "loss": 4.0},
           {"step": 2, "tokens": 20, "val_loss": 4.5}, {"step": 2, "tokens": 20, "loss": 3.9},
           {"step": 3, "tokens": 30, "loss": 3.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  train, valid = plot.read_curves(str(tmp_path))
  assert train == {1: (10, 5.0), 2: (20, 3.9), 3: (30, 3.0)} and valid == {2: (20, 4.5)}
  intervals, validations = log.read_metrics(str(tmp_path))  # the whole records, in step order
  assert list(intervals) == [1, 2, 3] and intervals[2] == lines[3] and validations == {2: lines[2]}
  assert plot.label(str(tmp_path)) == tmp_path.name  # no config.json: the name alone


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist; name the directory of a python -m train.gpt or train.grpo run"),
    ("no_run", "holds no run (no config.json, metrics.jsonl, checkpoints)"),
    ("no_metrics", "metrics.jsonl does not exist: the run has logged nothing yet"),
    ("empty_metrics", "holds no loss records"),
    ("not_json", "line 1 is not JSON"),
    ("bad_output", "cannot write"),
    ("bad_format", "matplotlib writes no .xyz images; use one of"),
])
def test_bad_input(runs, tmp_path, capsys, case, message):
  run, output = str(tmp_path / "run"), str(tmp_path / "curves.png")
  if case != "missing":
    os.makedirs(run)
  if case == "no_metrics":
    open(os.path.join(run, "config.json"), "w").close()
  if case == "empty_metrics":
    open(os.path.join(run, "metrics.jsonl"), "w").close()
  if case == "not_json":
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
      f.write("{truncated\n")
  if case == "bad_output":
    run, output = runs[0], str(tmp_path / "no" / "such" / "dir.png")
  if case == "bad_format":
    run, output = runs[0], str(tmp_path / "curves.xyz")
  assert plot.main([run, "--output", output]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
  assert not os.path.exists(output)


def _grpo_run(directory, rewards):
  os.makedirs(directory)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump({"train": {"optimizer": "adamw"}}, f)
  with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
    for step, reward in enumerate(rewards, 1):
      f.write(json.dumps({"step": step, "loss": 0.1, "reward_mean": reward}) + "\n")
  return str(directory)


def test_grpo_runs_plot_their_rewards(runs, tmp_path):
  """Two train.grpo runs (metrics.jsonl with reward_mean): their rewards against steps in
  C0 and C1; a GRPO run beside a train.gpt run is refused (one line, exit 2)."""
  rising = _grpo_run(tmp_path / "rising", np.linspace(0, 1, 20))
  flat = _grpo_run(tmp_path / "flat", np.full(20, 0.3))
  assert plot.read_rewards(rising) == pytest.approx(dict(enumerate(np.linspace(0, 1, 20), 1)))
  assert plot.read_rewards(runs[0]) is None
  output = str(tmp_path / "rewards.png")
  assert plot.main([rising, flat, "--output", output]) == 0
  image_HxWx4 = matplotlib.image.imread(output)
  assert _pixels_near(image_HxWx4, "C0") > 200 and _pixels_near(image_HxWx4, "C1") > 200
  assert plot.main([rising, runs[0], "--output", str(tmp_path / "mixed.png")]) == 2
  assert not os.path.exists(tmp_path / "mixed.png")


@pytest.mark.parametrize("name, magic", [("curves.pdf", b"%PDF-"), ("curves.svg", b"<?xml"), ("curves.PNG", b"\x89PNG")])
def test_the_extension_picks_the_format(runs, tmp_path, name, magic):
  output = str(tmp_path / name)
  assert plot.main([runs[0], "--output", output]) == 0
  with open(output, "rb") as f:
    assert f.read(len(magic)) == magic
