"""train.store.rundir: a run directory's refusals, metrics.jsonl as strict JSON, resumed flags."""
import json
import math
import re

import pytest

from train.cli import UsageError
from train.store import rundir


def test_metrics_are_strict_json_with_null_for_non_finite(tmp_path):
  metrics = rundir.MetricsFile(str(tmp_path))
  metrics.write({"step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": 0.5})
  metrics.close()
  line = (tmp_path / "metrics.jsonl").read_text()
  assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
      "step": 1, "loss": None, "grad_norm": None, "lr": 0.5}



def test_json_line_leaves_finite_values_and_other_types_alone():
  record = {"step": 3, "loss": 2.0, "name": "x", "big": 1e308, "small": -0.0, "inf": -math.inf}
  line = rundir.json_line(record)
  assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {**record, "inf": None}
  assert line.endswith("}\n") and line.count("\n") == 1

def test_resumed_keeps_saved_flags_and_refuses_fixed_ones_changed():
  saved = {"lr": 0.01, "steps": 2, "seed": 0}
  assert rundir.resumed(saved, {"steps": 4}, ("lr", "seed"), "why") == {"lr": 0.01, "steps": 4, "seed": 0}
  assert rundir.resumed(saved, {"lr": 0.01}, ("lr",), "why")["lr"] == 0.01  # the same value: fine
  with pytest.raises(UsageError, match=r"--resume --lr 0.5: the run was saved with 0.01, and its rollouts follow"):
    rundir.resumed(saved, {"lr": 0.5}, ("lr",), "its rollouts follow from it")


def test_check_refuses_what_a_run_cannot_use(tmp_path):
  directory = rundir.RunDirectory(str(tmp_path / "run"))
  assert directory.check(resume=False, step=None, steps=5) == 0  # a new run: nothing there yet
  with pytest.raises(UsageError, match="checkpoints does not exist; check --run-dir"):
    directory.check(resume=True, step=None, steps=5)
  for step in (2, 4):
    (tmp_path / "run" / "checkpoints" / str(step)).mkdir(parents=True)
  with pytest.raises(UsageError, match="already holds checkpoints \\(latest step 4\\); pass --resume"):
    directory.check(resume=False, step=None, steps=5)
  assert directory.check(resume=True, step=None, steps=5) == 4
  assert directory.check(resume=True, step=2, steps=5) == 2
  with pytest.raises(UsageError, match="--step 3: .* has checkpoints at steps 2, 4; pass one of them"):
    directory.check(resume=True, step=3, steps=5)
  with pytest.raises(UsageError, match="its checkpoint at step 4 reaches --steps 4"):
    directory.check(resume=True, step=None, steps=4)
  (tmp_path / "file").write_text("")
  with pytest.raises(UsageError, match="--run-dir .*file is a file, not a directory"):
    rundir.RunDirectory(str(tmp_path / "file")).check(resume=False, step=None, steps=5)


def test_check_run_tells_a_missing_path_a_file_and_a_folder_without_a_run(tmp_path):
  """What the commands that read a run (eval, sample, export, plot, grpo's --init-from) say."""
  (tmp_path / "file").write_text("x")
  (tmp_path / "empty").mkdir()
  for name, problem in (("absent", "does not exist"), ("file", "is a file, not a run directory"),
                        ("empty", "holds no run (no config.json, metrics.jsonl, checkpoints)")):
    with pytest.raises(UsageError, match=rf"^--init-from \S+{name} {re.escape(problem)}; name the directory"
                                         r" of a python -m train.gpt run .*, or hf:DIR$"):
      rundir.check_run(str(tmp_path / name), "--init-from", alternative=", or hf:DIR")
  for found in ("config.json", "metrics.jsonl", "checkpoints"):
    run = tmp_path / f"run-{found}"
    run.mkdir()
    (run / found).mkdir()
    rundir.check_run(str(run))  # any one of them: a run, possibly of an older layout


def test_open_takes_the_lock_writes_config_and_drops_newer_checkpoints(tmp_path, capsys):
  directory = rundir.RunDirectory(str(tmp_path / "run"))
  for step in (2, 4, 6):
    (tmp_path / "run" / "checkpoints" / str(step)).mkdir(parents=True)
  assert directory.open({"train": {"lr": 1}}, start_step=2)
  assert sorted(directory.existing_steps()) == [2]
  assert "deleting the newer checkpoints of steps 4, 6" in capsys.readouterr().err
  assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"train": {"lr": 1}}
  with pytest.raises(UsageError, match="is in use by another run"):
    rundir.RunDirectory(str(tmp_path / "run")).check(resume=True, step=None, steps=9)
  (tmp_path / "run" / "checkpoints" / f"8{rundir.PARTIAL_MARK}1").mkdir()
  directory.close()
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "config.json"]
  assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["2"]
