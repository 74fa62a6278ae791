"""Megatron-style log lines on stdout and the same numbers in ``metrics.jsonl``.

    iteration       10/     200 | consumed tokens: 20480 | elapsed time per iteration (ms): 612.3 |
    tokens/s: 3345 | TFLOP/s per device: 0.02 | learning rate: 1.000000E-02 |
    lm loss: 5.123456E+00 | grad norm: 1.234 | skipped iterations: 0 | nan iterations: 0

(one line). MFU appears where the device's peak is known, the loss scale (after the lm
loss, as Megatron's) in float16 runs: that of the interval's last step. On fine-tuning
data (``sft:``) the line also shows the examples consumed so far and the epoch, steps
over the steps of one pass over the data's rows (1.500: half way through the second
pass). Only process 0 writes; :func:`read_metrics` is the one reader of what it writes.
"""
from __future__ import annotations

import json
import math
import os
import time

from train import rundir
from train.cli import UsageError

# Dense bf16 peak TFLOP/s per device, by jax's device_kind.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0,
               "L4": 121.0, "A10G": 70.0, "V100": 125.0}


def peak_tflops(device_kind: str) -> float | None:
  for name, peak in PEAK_TFLOPS.items():
    if name.lower() in device_kind.lower():
      return peak
  return None


class Logger:
  """Averages the steps of each log interval and writes them out."""

  def __init__(self, run_path: str, steps: int, tokens_per_step: int, flops_per_token: float,
               num_devices: int, device_kind: str, primary: bool, steps_per_epoch: int | None = None,
               examples: int | None = 0):
    """``steps_per_epoch`` (fine-tuning data only): steps of one pass over the data;
    ``examples``: those consumed before this run's first step (a resumed run's; None when
    its checkpoint did not record them: they are then not shown)."""
    self.steps, self.tokens_per_step = steps, tokens_per_step
    self.steps_per_epoch, self.examples = steps_per_epoch, examples
    self.flops_per_token, self.num_devices = flops_per_token, num_devices
    self.peak = peak_tflops(device_kind)
    self.primary = primary
    self.metrics = rundir.MetricsFile(run_path) if primary else None
    self._reset(time.perf_counter())

  def _reset(self, now: float) -> None:
    self.start, self.count = now, 0
    self.losses, self.nan, self.skipped = [], 0, 0
    self.grad_norm, self.lr = math.nan, math.nan
    self.loss_scale = None
    self.qk_clip = None
    self.routing = None

  def step(self, loss: float, grad_norm: float, lr: float, skipped: bool,
           loss_scale: float | None = None, qk_clip: tuple[float, int] | None = None,
           routing: tuple[float, float, float] | None = None, examples: int | None = None) -> None:
    """One step's numbers; ``loss_scale`` (the scale its loss was multiplied by) in float16
    runs; ``qk_clip``: the step's largest attention logit and the heads QK-clip shrank;
    ``routing`` (MoE models): the router's auxiliary loss, the worst layer's max/mean
    tokens per expert, the share of assignments dropped; ``examples``: the fine-tuning
    examples of its batch."""
    self.count += 1
    if self.examples is not None and examples is not None:
      self.examples += examples
    self.skipped += skipped
    self.nan += not math.isfinite(loss)
    if not skipped:
      self.losses.append(loss)
      self.grad_norm = grad_norm
    self.lr = lr
    self.loss_scale = loss_scale
    if qk_clip is not None:
      largest, clipped = self.qk_clip or (-math.inf, 0)
      self.qk_clip = (max(largest, qk_clip[0]), clipped + qk_clip[1])
    if routing is not None:  # the interval's mean of each
      total = self.routing or (0.0, 0.0, 0.0)
      self.routing = tuple(t + r for t, r in zip(total, routing))

  def flush(self, step: int) -> None:
    """Writes the line of the interval that ends at ``step``."""
    now = time.perf_counter()
    ms = 1e3 * (now - self.start) / max(self.count, 1)
    tokens_per_s = self.tokens_per_step / (ms / 1e3)
    tflops = tokens_per_s * self.flops_per_token / self.num_devices / 1e12
    loss = sum(self.losses) / len(self.losses) if self.losses else math.nan
    record = {"step": step, "tokens": step * self.tokens_per_step, "ms_per_step": ms,
              "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
              "learning_rate": self.lr, "loss": loss, "grad_norm": self.grad_norm,
              "skipped": self.skipped, "nan": self.nan}
    fields = [f"iteration {step:8d}/{self.steps:8d}", f"consumed tokens: {record['tokens']}"]
    if self.examples is not None and self.steps_per_epoch:
      record["examples"] = self.examples
      fields.append(f"consumed examples: {self.examples}")
    if self.steps_per_epoch:
      record["epoch"] = step / self.steps_per_epoch
      fields.append(f"epoch: {record['epoch']:.3f}")
    fields += [f"elapsed time per iteration (ms): {ms:.1f}", f"tokens/s: {tokens_per_s:.0f}",
               f"TFLOP/s per device: {tflops:.3f}"]
    if self.peak:
      record["mfu"] = tflops / self.peak
      fields.append(f"MFU: {100 * record['mfu']:.1f}%")
    fields += [f"learning rate: {self.lr:.6E}", f"lm loss: {loss:.6E}"]
    if self.loss_scale is not None:
      record["loss_scale"] = self.loss_scale
      fields.append(f"loss scale: {self.loss_scale:.1f}")
    if self.qk_clip is not None:
      record["max_logit"], record["clipped_heads"] = self.qk_clip
      fields += [f"max attention logit: {self.qk_clip[0]:.2f}", f"QK-clipped heads: {self.qk_clip[1]}"]
    if self.routing is not None:
      aux, load, dropped = (r / max(self.count, 1) for r in self.routing)
      record.update(moe_aux_loss=aux, expert_load=load, dropped=dropped)
      fields += [f"moe aux loss: {aux:.4E}", f"expert load max/mean: {load:.2f}", f"dropped: {100 * dropped:.1f}%"]
    fields += [f"grad norm: {self.grad_norm:.3f}", f"skipped iterations: {self.skipped}",
               f"nan iterations: {self.nan}"]
    self._write(" | ".join(fields), record)
    self._reset(now)

  def validation(self, step: int, loss: float, targets: int, seconds: float) -> None:
    """Logs an evaluation over ``targets`` counted targets that took ``seconds``, which do
    not count as training time."""
    ppl = math.exp(min(loss, 700.0))
    self._write(f"validation at iteration {step:8d} | validation lm loss: {loss:.6E} |"
                f" validation lm loss PPL: {ppl:.6E} | targets: {targets}",
                {"step": step, "tokens": step * self.tokens_per_step, "val_loss": loss, "val_ppl": ppl})
    self.start += seconds

  def message(self, text: str) -> None:
    if self.primary:
      print(text, flush=True)

  def _write(self, line: str, record: dict) -> None:
    if self.primary:
      print(line, flush=True)
      self.metrics.write(record)

  def close(self) -> None:
    if self.metrics:
      self.metrics.close()


def read_metrics(run_dir: str) -> tuple[dict[int, dict], dict[int, dict]]:
  """The run's interval records (with ``loss``) and validation records (with ``val_loss``).

  Each is ``{step: record}`` in step order. Keyed by step so that a resumed run's
  records of the same step (a killed run may have logged past its last checkpoint)
  replace the earlier ones. Raises UsageError for a missing run directory or
  metrics.jsonl, a line that is not JSON, or a file without records.
  """
  if not os.path.isdir(run_dir):
    raise UsageError(f"run directory {run_dir} does not exist; pass the --run-dir of a"
                     " python -m train.gpt run")
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise UsageError(f"{path} does not exist: the run has logged nothing yet")
  train, valid = {}, {}
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        raise UsageError(f"{path} line {number} is not JSON; is it a metrics.jsonl of"
                         " python -m train.gpt?") from None
      if "loss" in record:
        train[record["step"]] = record
      elif "val_loss" in record:
        valid[record["step"]] = record
  if not train and not valid:
    raise UsageError(f"{path} holds no loss records: the run has logged nothing yet")
  return dict(sorted(train.items())), dict(sorted(valid.items()))
