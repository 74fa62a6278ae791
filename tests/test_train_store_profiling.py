"""``--profile-steps A:B`` (``train/store/profiling.py``): a profiled CPU run writes a trace of
exactly the chosen steps, each named with its step number, where TensorBoard's profile
plugin and Perfetto look; a malformed range is one line. (``train.gpu``'s profile stage
takes its trace this way: ``tests/test_train_gpu.py``.)"""
import glob
import gzip
import json

import pytest

from tests.test_train_gpt import SMALL
from train import gpt
from train.store import profiling


def traced_steps(run_dir) -> list[int]:
  (path,) = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
  return annotated_steps(path)


def annotated_steps(path: str) -> list[int]:
  """The step numbers of the trace's training-step annotations."""
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == profiling.STEP_NAME and e.get("ph") == "X")


def test_a_profiled_run_traces_the_chosen_steps(tmp_path):
  run_dir = tmp_path / "run"
  assert gpt.main([*SMALL, "--run-dir", str(run_dir), "--steps", "4", "--profile-steps", "2:3", "--mesh", "fs=1",
                   "--eval-tokens", "0"]) == 0
  assert traced_steps(run_dir) == [2, 3]
  # The XSpace TensorBoard's profile plugin reads (tensorboard --logdir RUN_DIR/profile).
  assert glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  with open(run_dir / "config.json") as f:  # a profile belongs to one invocation: --resume does not repeat it
    assert json.load(f)["train"]["profile_steps"] == "2:3"


@pytest.mark.parametrize("steps, message", [
    ("3", "--profile-steps 3: expected A:B"), ("4:2", "--profile-steps 4:2: expected A:B"),
    ("0:1", "--profile-steps 0:1: expected A:B"), ("2:9", "--profile-steps 2:9 ends past --steps 4"),
])
def test_a_bad_range_is_one_line(steps, message, tmp_path, capsys):
  assert gpt.main([*SMALL, "--run-dir", str(tmp_path / "run"), "--steps", "4", "--profile-steps", steps]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
  assert not (tmp_path / "run").exists()
