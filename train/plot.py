"""Loss curves of runs: ``python -m train.plot RUN_DIR [RUN_DIR ...] [--output curves.png]``.

Reads each run's ``metrics.jsonl`` (``train/log.py``: a record with ``loss`` per log
interval, one with ``val_loss`` per evaluation, both with the consumed ``tokens``) and
draws training loss (solid) and validation loss (dashed, dots) against tokens, one
colour per run, into a PNG.

A missing run directory or a missing or empty ``metrics.jsonl`` prints one
``error: ...`` line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none opened
import matplotlib.pyplot as plt  # noqa: E402

from train.config import UsageError  # noqa: E402

EXIT_USAGE = 2
FIGSIZE, DPI = (8.0, 5.0), 100  # an 800 x 500 PNG


def read_curves(run_dir: str) -> tuple[dict[int, tuple[int, float]], dict[int, tuple[int, float]]]:
  """The run's training and validation points, ``{step: (tokens, loss)}`` each.

  Keyed by step so that a resumed run's records of the same step (a killed run may
  have logged past its last checkpoint) replace the earlier ones.
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
        train[record["step"]] = (record["tokens"], record["loss"])
      elif "val_loss" in record:
        valid[record["step"]] = (record["tokens"], record["val_loss"])
  if not train and not valid:
    raise UsageError(f"{path} holds no loss records: the run has logged nothing yet")
  return train, valid


def label(run_dir: str) -> str:
  """The run directory's name, with its optimizer when the name does not say it."""
  name = os.path.basename(os.path.normpath(run_dir))
  try:
    with open(os.path.join(run_dir, "config.json")) as f:
      optimizer = json.load(f)["train"]["optimizer"]
  except (OSError, ValueError, KeyError):
    return name
  return name if optimizer in name else f"{name} ({optimizer})"


def plot(run_dirs: list[str], output: str) -> None:
  """Draws the curves of ``run_dirs`` into the PNG ``output``."""
  curves = [(label(d), *read_curves(d)) for d in run_dirs]
  fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
  for i, (name, train, valid) in enumerate(curves):
    colour = f"C{i % 10}"
    if train:
      tokens, losses = zip(*(train[s] for s in sorted(train)))
      ax.plot(tokens, losses, color=colour, lw=1.5, label=f"{name} train")
    if valid:
      tokens, losses = zip(*(valid[s] for s in sorted(valid)))
      ax.plot(tokens, losses, color=colour, lw=1.5, ls="--", marker="o", ms=4, label=f"{name} validation")
  ax.set_xlabel("tokens")
  ax.set_ylabel("lm loss (nats per token)")
  ax.set_title("loss curves")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  try:
    fig.savefig(output, format="png")
  except OSError as e:
    raise UsageError(f"cannot write {output}: {e.strerror}; choose another --output") from None
  finally:
    plt.close(fig)


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(f"{message} (see python -m train.plot --help)")


def main(argv: list[str] | None = None) -> int:
  parser = _Parser(prog="python -m train.plot",
                   description="Draw the train and validation loss of runs against tokens into a PNG.")
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of python -m train.gpt")
  parser.add_argument("--output", default="curves.png", help="the PNG to write (default curves.png)")
  try:
    args = parser.parse_args(argv)
    plot(args.run_dirs, args.output)
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  print(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
