"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

- ``--tensorboard [DIR]``: event files in DIR (default ``RUN_DIR/tensorboard``) through
  TensorBoard's own numpy-only writer (``tensorboard.summary.Writer``, no TensorFlow):
  ``tensorboard --logdir DIR``.
- ``--wandb PROJECT``: a W&B run in PROJECT named after the run directory, its config the
  run's ``config.json`` record, its files in ``RUN_DIR/wandb``; ``WANDB_MODE=offline``
  writes them without a network (``wandb sync`` uploads them later).

Each tracker gets every record of ``metrics.jsonl`` (``train.store.rundir.MetricsFile``): one
scalar per numeric field, named as the field (``loss``, ``val_loss``, ``learning_rate``,
``grad_norm``, ``tokens_per_s``, ``mfu``, ``skipped``; GRPO's ``reward_mean``,
``reward/NAME/mean``, ``kl``, ``clip_low``, ...), at the record's ``step``; a
non-finite value is sent as it is (metrics.jsonl writes it as null). Both packages are
optional extras (``pip install 'dion-jax[tensorboard,wandb]'``); :func:`check` refuses a
missing one before the run starts. Only process 0 tracks. Nothing here imports jax.
"""
from __future__ import annotations

import importlib.util
import os

from train.cli import UsageError
from train.store import rundir

_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check(tensorboard: str | None, wandb: str | None) -> None:
  """Raises UsageError when a requested tracker's package is not installed, or when
  ``tensorboard`` names a directory that cannot be written ("": the run directory's,
  which the run checks itself)."""
  for flag, value in (("tensorboard", tensorboard), ("wandb", wandb)):
    if value is not None and importlib.util.find_spec(flag) is None:
      raise UsageError(f"--{flag} needs the {flag} package: pip install 'dion-jax[{_EXTRA[flag]}]'"
                       f" (or drop --{flag})")
  if tensorboard:
    rundir.check_usable(os.path.abspath(tensorboard), "--tensorboard")


def start(run_path: str, config: dict, tensorboard: str | None, wandb: str | None) -> list:
  """The trackers of a run in ``run_path``: TensorBoard event files in ``tensorboard``
  (a directory), a W&B run in project ``wandb`` with ``config``; none for None."""
  check(tensorboard, wandb)
  trackers = []
  if tensorboard is not None:
    trackers.append(TensorBoard(tensorboard))
  if wandb is not None:
    trackers.append(WandB(wandb, run_path, config))
  return trackers


def scalars(record: dict) -> dict[str, float]:
  """The numeric fields of a record, ``step`` left out."""
  return {k: float(v) for k, v in record.items()
          if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
  """Event files in ``directory``, one scalar summary per numeric field of each record."""

  def __init__(self, directory: str):
    from tensorboard.summary import Writer

    self.writer = Writer(directory)

  def log(self, record: dict) -> None:
    for tag, value in scalars(record).items():
      self.writer.add_scalar(tag, value, step=record["step"])
    self.writer.flush()

  def close(self) -> None:
    self.writer.close()


class WandB:
  """A Weights & Biases run of ``project``, its files in ``run_path/wandb``."""

  def __init__(self, project: str, run_path: str, config: dict):
    import wandb

    os.makedirs(run_path, exist_ok=True)
    try:
      self.run = wandb.init(project=project, name=os.path.basename(run_path), dir=run_path, config=config)
    except Exception as e:  # noqa: BLE001  wandb's errors (login, network) have no common base class
      raise UsageError(f"--wandb {project}: W&B did not start ({str(e).splitlines()[0] if str(e) else type(e).__name__});"
                       " log in with `wandb login`, or set WANDB_MODE=offline to write the run locally") from None

  def log(self, record: dict) -> None:
    self.run.log(scalars(record), step=record["step"])

  def close(self) -> None:
    self.run.finish()
