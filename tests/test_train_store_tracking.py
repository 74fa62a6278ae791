"""TensorBoard and W&B (``train/store/tracking.py``): what their own readers find after a run of
``train.gpt`` and of ``train.grpo`` is what ``metrics.jsonl`` holds, and a missing extra
is refused with one line before anything starts.

TensorBoard's event files are read with TensorBoard's ``EventAccumulator``; W&B's offline
run (``WANDB_MODE=offline``) from its transaction log, ``run-ID.wandb``: W&B's records
(``wandb.proto.wandb_internal_pb2.Record``) in LevelDB's log format, which ``wandb sync``
uploads. Each test reads the trackers whose extras are installed (``pip install -e ".[dev]"``
installs both) and skips when its own or neither is.
"""
import glob
import importlib.util
import json
import math
import struct

import numpy as np
import pytest

from tests.test_train_gpt import SMALL
from tests.test_train_grpo import base_run  # noqa: F401  fixture
from train import gpt
from train.grpo import __main__ as grpo
from train.store import tracking

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard extra: pip install -e \".[dev]\"")


def trackers_flags() -> list[str]:
  return ["--tensorboard"] * HAS_TENSORBOARD + ["--wandb", "dion-jax-tests"] * HAS_WANDB


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
  """Four steps of train.gpt with validation every 2, logged every step to both trackers."""
  run_dir = tmp_path_factory.mktemp("tracking") / "gpt"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    assert gpt.main([*SMALL, "--run-dir", str(run_dir), "--steps", "4", "--eval-every", "2", "--mesh", "fs=2",
                     *trackers_flags()]) == 0
  return run_dir


@pytest.fixture(scope="module")
def grpo_run(base_run, tmp_path_factory):  # noqa: F811
  prompts = tmp_path_factory.mktemp("tracking_prompts") / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in [("1+2=", "3"), ("4+4=", "8")]))
  run_dir = tmp_path_factory.mktemp("tracking") / "grpo"
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    assert grpo.main(["--init-from", base_run, "--prompts", str(prompts), "--run-dir", str(run_dir), "--steps", "2",
                      "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--beta", "0.04",
                      "--reward", "tests.test_train_grpo:digits_reward", "--reward", "format=0.5",
                      *trackers_flags()]) == 0
  return run_dir


def metrics(run_dir) -> dict[tuple[str, int], float]:
  """``{(field, step): value}`` of every numeric field of metrics.jsonl, null as NaN."""
  out = {}
  with open(run_dir / "metrics.jsonl") as f:
    for line in f:
      record = json.loads(line, parse_constant=lambda c: pytest.fail(f"metrics.jsonl holds a bare {c}"))
      for key, value in record.items():
        if key != "step":
          out[key, record["step"]] = math.nan if value is None else float(value)
  return out


def tensorboard_scalars(directory) -> dict[tuple[str, int], float]:
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.util import tensor_util

  reader = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.TENSORS: 0})
  reader.Reload()
  return {(tag, e.step): float(tensor_util.make_ndarray(e.tensor_proto))
          for tag in reader.Tags()["tensors"] for e in reader.Tensors(tag)}


def wandb_records(run_dir) -> list:
  """The records of the run's offline transaction log (LevelDB log format: 32 KiB blocks
  of chunks, each a 7-byte header crc32, length, type (1 full, 2 first, 3 middle, 4 last);
  the file starts with a 7-byte W&B header)."""
  from wandb.proto import wandb_internal_pb2

  (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
  data = open(path, "rb").read()
  block, pos, records, pending = 32768, 7, [], b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
      pending = b""
  return records


def wandb_history(run_dir) -> dict[tuple[str, int], float]:
  out = {}
  for record in wandb_records(run_dir):
    if record.WhichOneof("record_type") == "history":
      items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
      step = items["_step"]
      out.update({(k, step): float(v) for k, v in items.items() if not k.startswith("_")})
  return out


def assert_same(got: dict, expected: dict, cast=float) -> None:
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    want = cast(value)
    assert got[key] == want or (math.isnan(got[key]) and math.isnan(want)), (key, got[key], want)


# One test per run, each reading both trackers: a module fixture used by two tests runs once in
# each pytest-xdist worker that gets one of them (a train.gpt or train.grpo run each time).
needs_a_tracker = pytest.mark.skipif(not (HAS_TENSORBOARD or HAS_WANDB),
                                     reason="needs the tensorboard or wandb extra: pip install -e \".[dev]\"")


def assert_wandb_holds_metrics_jsonl_and_the_config(run_dir) -> None:
  assert_same(wandb_history(run_dir), metrics(run_dir))
  (run,) = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
  config = {item.key: json.loads(item.value_json) for item in run.config.update}
  with open(run_dir / "config.json") as f:
    saved = json.load(f)
  assert run.project == "dion-jax-tests" and run.display_name == run_dir.name
  assert {k: config[k] for k in saved} == saved


@needs_a_tracker
def test_tensorboard_and_wandb_hold_metrics_jsonl_of_train_gpt(gpt_run):
  """TensorBoard's scalars (float32) and W&B's offline history are metrics.jsonl's; W&B's run
  holds config.json."""
  expected = metrics(gpt_run)
  assert {"loss", "val_loss", "learning_rate", "grad_norm", "tokens_per_s", "skipped"} <= {k for k, _ in expected}
  assert ("val_loss", 2) in expected and ("loss", 4) in expected
  if HAS_TENSORBOARD:  # TensorBoard stores float32 scalars.
    assert_same(tensorboard_scalars(gpt_run / "tensorboard"), expected, cast=lambda v: float(np.float32(v)))
  if HAS_WANDB:
    assert_wandb_holds_metrics_jsonl_and_the_config(gpt_run)


@needs_a_tracker
def test_tensorboard_and_wandb_hold_metrics_jsonl_of_train_grpo(grpo_run):
  """As train.gpt's, for train.grpo's records (rewards, KL, clip shares)."""
  expected = metrics(grpo_run)
  assert {"reward_mean", "reward/format/mean", "kl", "clip_low", "clip_high", "loss"} <= {k for k, _ in expected}
  if HAS_TENSORBOARD:
    assert_same(tensorboard_scalars(grpo_run / "tensorboard"), expected, cast=lambda v: float(np.float32(v)))
  if HAS_WANDB:
    assert_wandb_holds_metrics_jsonl_and_the_config(grpo_run)


@pytest.mark.parametrize("missing", ["tensorboard", "wandb"])
def test_a_missing_extra_is_one_line_before_the_run(missing, tmp_path, capsys, monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == missing else find_spec(name))
  flag = ["--tensorboard"] if missing == "tensorboard" else ["--wandb", "p"]
  assert gpt.main([*SMALL, "--run-dir", str(tmp_path / "run"), *flag]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: --{missing} needs the {missing} package: pip install 'dion-jax[{missing}]' (or drop --{missing})"]
  assert not (tmp_path / "run").exists()


@needs_tensorboard
def test_a_tensorboard_directory_under_a_file_is_one_line(tmp_path, capsys):
  (tmp_path / "a_file").write_text("")
  assert gpt.main([*SMALL, "--run-dir", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "a_file" / "tb")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: --tensorboard {tmp_path / 'a_file' / 'tb'} lies under the file {tmp_path / 'a_file'}, not a"
                 " directory; choose a directory"]
  assert not (tmp_path / "run").exists()
