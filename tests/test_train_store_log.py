"""``metrics.jsonl`` is strict JSON (``train/store/log.py``): an interval whose every step was
skipped has no finite loss; it is written as null, which strict parsers accept, reads
back as NaN, and reaches the trackers as it was (NaN, inf)."""
import json
import math

import pytest

from train.store import log


class Recorder:
  """A tracker that keeps what it is given."""

  def __init__(self):
    self.records, self.closed = [], False

  def log(self, record):
    self.records.append(record)

  def close(self):
    self.closed = True


def strict(line: str) -> dict:
  return json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: bare {c}"))


def test_a_non_finite_loss_is_null_read_back_as_nan(tmp_path):
  tracker = Recorder()
  logger = log.Logger(str(tmp_path), steps=2, tokens_per_step=8, flops_per_token=1.0, num_devices=1,
                      device_kind="cpu", primary=True, trackers=[tracker])
  logger.step(loss=1.5, grad_norm=0.5, lr=0.1, skipped=False)
  logger.flush(1)
  logger.step(loss=math.nan, grad_norm=math.inf, lr=0.1, skipped=True)
  logger.flush(2)
  logger.validation(2, loss=math.inf, targets=4, seconds=0.0)
  logger.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  first, second, valid = (strict(line) for line in lines)
  assert first["loss"] == 1.5 and first["grad_norm"] == 0.5
  assert second["loss"] is None and second["skipped"] == 1 and second["nan"] == 1
  assert second["grad_norm"] is None  # no step of the interval was applied
  assert valid["val_loss"] is None and valid["val_ppl"] is not None  # exp(min(inf, 700)) is finite
  train, validation = log.read_metrics(str(tmp_path))
  assert train[1]["loss"] == 1.5 and math.isnan(train[2]["loss"]) and math.isnan(validation[2]["val_loss"])
  assert [r["step"] for r in tracker.records] == [1, 2, 2] and tracker.closed
  assert math.isnan(tracker.records[1]["loss"]) and tracker.records[2]["val_loss"] == math.inf



def test_the_line_names_the_gradient_norm(tmp_path, capsys):
  """The name the trainer gives (``train.run.grad_norm.LOG_NAMES``) says which norm is shown."""
  from train.run import grad_norm
  logger = log.Logger(str(tmp_path), steps=1, tokens_per_step=8, flops_per_token=1.0, num_devices=1,
                      device_kind="cpu", primary=True, grad_norm_name=grad_norm.LOG_NAMES["sketch"])
  logger.step(loss=1.5, grad_norm=0.5, lr=0.1, skipped=False)
  logger.flush(1)
  logger.close()
  assert "| grad norm (sketch estimate): 0.500 |" in capsys.readouterr().out


def test_counts_read_as_english():
  """``done: 1 steps``, ``(1 process(es))`` were the lines' plurals."""
  assert [log.counted(n, "step") for n in (1, 2)] == ["1 step", "2 steps"]
  assert [log.processes(n) for n in (1, 2)] == ["1 process", "2 processes"]
