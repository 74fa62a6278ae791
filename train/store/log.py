"""Megatron-style log lines on stdout and the same numbers in ``metrics.jsonl``.

    iteration       10/     200 | consumed tokens: 20480 | elapsed time per iteration (ms): 612.3 |
    tokens/s: 3345 | TFLOP/s per device: 0.02 | learning rate: 1.000000E-02 |
    lm loss: 5.123456E+00 | grad norm: 1.234 | skipped iterations: 0 | nan iterations: 0

(one line), for the first iteration as it ends, then every ``--log-interval`` and at the last
step; a legend (:meth:`Logger.legend`) says once what the numbers are: ``lm loss`` the
interval's mean, in nats per token, ``grad norm`` its last applied step's before clipping,
the counts the interval's. MFU appears where the device's peak is known, the loss scale (after the lm
loss, as Megatron's) in float16 runs: that of the interval's last step; with --skip-spikes,
the skipped iterations that were spikes (``spike iterations``). Where Dion's replicas
keep their own gradients, the grad norm's name says how it was taken (``grad norm (sketch
estimate)``, ``train/run/grad_norm.py``). On fine-tuning
data (``sft:``) the line also shows the examples consumed so far and the epoch, steps
over the steps of one pass over the data's rows (1.500: half way through the second
pass). Only process 0 writes; :func:`read_metrics` is the one reader of what it writes.

``metrics.jsonl`` is strict JSON, one object a line (``train.store.rundir.MetricsFile``, which
``train.grpo`` writes through too): a value that is not finite (the loss of an interval
whose steps were all skipped) is ``null``, never the bare ``NaN`` that ``jq`` and strict
parsers refuse. Every record also goes to the run's trackers (``train/store/tracking.py``:
``--tensorboard``, ``--wandb``), one scalar per numeric field. The fields:

- ``train.gpt``, one record per log interval: ``step``, ``tokens`` (consumed),
  ``ms_per_step``, ``tokens_per_s``, ``tflops_per_device``, ``mfu`` (known peaks only),
  ``learning_rate``, ``loss`` (the interval's mean lm loss), ``grad_norm`` (its last
  applied step's), ``skipped``, ``nan``, and where they apply ``examples``, ``epoch``
  (``sft:`` data), ``loss_scale`` (float16), ``max_logit``, ``clipped_heads`` (QK-clip),
  ``moe_aux_loss``, ``expert_load``, ``dropped`` (experts); one per evaluation: ``step``,
  ``tokens``, ``val_loss``, ``val_ppl``.
- ``train.grpo``, one record per step: ``step``, ``reward_mean``, ``reward_std`` (the
  weighted sum of the rewards), ``reward/NAME/mean`` and ``reward/NAME/std`` per reward
  function, ``advantage_std``, ``loss``, ``kl`` (k3, to the starting policy), ``clip_low``,
  ``clip_high`` (shares of completion tokens whose ratio was clipped below / above),
  ``grad_norm``, ``completion_length_mean``, ``completion_length_max``, ``truncated``
  (the share cut at ``--max-new-tokens``), ``rollout_tokens_per_s``,
  ``train_tokens_per_s``, ``rollout_s``, ``train_s``.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence

from train.cli import UsageError
from train.store import rundir

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
               examples: int | None = 0, trackers: Sequence = (), grad_norm_name: str = "grad norm"):
    """``steps_per_epoch`` (fine-tuning data only): steps of one pass over the data;
    ``examples``: those consumed before this run's first step (a resumed run's; None when
    its checkpoint did not record them: they are then not shown); ``trackers``: where
    the records go besides metrics.jsonl (``train.store.tracking.start``'s);
    ``grad_norm_name``: the line's name of the norm, which says how it was taken."""
    self.steps, self.tokens_per_step = steps, tokens_per_step
    self.steps_per_epoch, self.examples = steps_per_epoch, examples
    self.flops_per_token, self.num_devices = flops_per_token, num_devices
    self.peak = peak_tflops(device_kind)
    self.primary, self.grad_norm_name = primary, grad_norm_name
    self.metrics = rundir.MetricsFile(run_path, trackers) if primary else None
    self._reset(time.perf_counter())

  def _reset(self, now: float) -> None:
    self.start, self.count = now, 0
    self.losses, self.nan, self.skipped, self.spikes = [], 0, 0, None
    self.grad_norm, self.lr = math.nan, math.nan
    self.loss_scale = None
    self.qk_clip = None
    self.routing = None

  def step(self, loss: float, grad_norm: float, lr: float, skipped: bool,
           loss_scale: float | None = None, qk_clip: tuple[float, int] | None = None,
           routing: tuple[float, float, float] | None = None, examples: int | None = None,
           spike: bool | None = None) -> None:
    """One step's numbers; ``loss_scale`` (the scale its loss was multiplied by) in float16
    runs; ``qk_clip``: the step's largest attention logit and the heads QK-clip shrank;
    ``routing`` (MoE models): the router's auxiliary loss, the worst layer's max/mean
    tokens per expert, the share of assignments dropped; ``examples``: the fine-tuning
    examples of its batch; ``spike`` (with --skip-spikes): whether it was skipped as a spike
    (counted in ``skipped`` too)."""
    self.count += 1
    if self.examples is not None and examples is not None:
      self.examples += examples
    self.skipped += skipped
    if spike is not None:
      self.spikes = (self.spikes or 0) + spike
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
    fields += [f"{self.grad_norm_name}: {self.grad_norm:.3f}", f"skipped iterations: {self.skipped}",
               f"nan iterations: {self.nan}"]
    if self.spikes is not None:
      record["spikes"] = self.spikes
      fields.append(f"spike iterations: {self.spikes}")
    self._write(" | ".join(fields), record)
    self._reset(now)

  def validation(self, step: int, loss: float, targets: int, seconds: float) -> None:
    """Logs an evaluation over ``targets`` counted targets that took ``seconds``, which do
    not count as training time."""
    self._write(f"validation at iteration {step:8d} | {validation_fields(loss, targets)}",
                {"step": step, "tokens": step * self.tokens_per_step, "val_loss": loss,
                 "val_ppl": math.exp(min(loss, 700.0))})
    self.start += seconds

  def legend(self, clip_grad: float) -> None:
    """What the line's numbers are, once before the first (``--clip-grad``: the clipping)."""
    clipped = f"clipping to --clip-grad {clip_grad:g}" if clip_grad else "no clipping (--clip-grad 0)"
    self.message("each line: lm loss = the mean over the interval's applied steps, in nats per token"
                 f" (per byte with the byte tokenizer); grad norm = its last applied step's, before {clipped};"
                 " skipped iterations = the interval's steps not applied (non-finite or a spike),"
                 " nan iterations = those with a non-finite loss")

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


def counted(count: int, one: str, many: str | None = None) -> str:
  """``1 step``, ``2 steps``; ``many`` names an irregular plural."""
  return f"{count} {one if count == 1 else many or one + 's'}"


def processes(count: int) -> str:
  """``1 process``, ``2 processes``."""
  return counted(count, "process", "processes")


def validation_fields(loss: float, targets: int) -> str:
  """The validation loss as the trainer and ``train.eval`` print it (nats per target token)."""
  return (f"validation lm loss: {loss:.6E} | validation lm loss PPL: {math.exp(min(loss, 700.0)):.6E} |"
          f" targets: {targets}")


def read_metrics(run_dir: str) -> tuple[dict[int, dict], dict[int, dict]]:
  """The run's interval records (with ``loss``) and validation records (with ``val_loss``).

  Each is ``{step: record}`` in step order, a null (not finite) read as NaN. Keyed by
  step so that a resumed run's records of the same step (a killed run may have logged
  past its last checkpoint) replace the earlier ones. Raises UsageError for a missing run
  directory or metrics.jsonl, a line that is not JSON, or a file without records.
  """
  rundir.check_run(run_dir, runs="python -m train.gpt or train.grpo")
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
        record = {k: math.nan if v is None else v for k, v in record.items()}
      except (json.JSONDecodeError, AttributeError):
        raise UsageError(f"{path} line {number} is not JSON; is it a metrics.jsonl of"
                         " python -m train.gpt?") from None
      if "loss" in record:
        train[record["step"]] = record
      elif "val_loss" in record:
        valid[record["step"]] = record
  if not train and not valid:
    raise UsageError(f"{path} holds no loss records: the run has logged nothing yet")
  return dict(sorted(train.items())), dict(sorted(valid.items()))
