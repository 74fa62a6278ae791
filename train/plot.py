"""Loss curves of runs: ``python -m train.plot RUN_DIR [RUN_DIR ...] [--output curves.png]``.

Reads each run's ``metrics.jsonl`` (``train/store/log.py``: a record with ``loss`` per log
interval, one with ``val_loss`` per evaluation, both with the consumed ``tokens``) and
draws training loss (solid) and validation loss (dashed, dots) against tokens, one
colour per run, into an image whose format the output's extension names (PNG, PDF, SVG,
... as matplotlib writes them; PNG without an extension). Runs of ``python -m train.grpo``
get their mean reward against steps instead.

A missing run directory or a missing or empty ``metrics.jsonl`` prints one
``error: ...`` line on stderr and exits with code 2.
"""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none opened
import matplotlib.pyplot as plt  # noqa: E402

from train import cli  # noqa: E402
from train.cli import UsageError  # noqa: E402
from train.store import log

FIGSIZE, DPI = (8.0, 5.0), 100  # an 800 x 500 PNG


def read_curves(run_dir: str) -> tuple[dict[int, tuple[int, float]], dict[int, tuple[int, float]]]:
  """The run's training and validation points, ``{step: (tokens, loss)}`` each."""
  train, valid = log.read_metrics(run_dir)
  return ({step: (r["tokens"], r["loss"]) for step, r in train.items()},
          {step: (r["tokens"], r["val_loss"]) for step, r in valid.items()})


def read_rewards(run_dir: str) -> dict[int, float] | None:
  """A ``python -m train.grpo`` run's mean reward per step, ``{step: reward}``; None for a
  run of ``python -m train.gpt``."""
  train, _ = log.read_metrics(run_dir)
  if not any("reward_mean" in r for r in train.values()):
    return None
  return {step: r["reward_mean"] for step, r in train.items()}


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
  """Draws the curves of ``run_dirs`` into ``output``, in the format of its extension: loss
  against tokens, or for GRPO runs the mean reward against steps."""
  rewards = [read_rewards(d) for d in run_dirs]
  if any(r is not None for r in rewards):
    if not all(r is not None for r in rewards):
      raise UsageError("GRPO runs (python -m train.grpo) plot rewards, train.gpt runs losses: plot them separately")
    fig, ax = _figure(output)
    for i, (run_dir, reward) in enumerate(zip(run_dirs, rewards)):
      ax.plot(sorted(reward), [reward[s] for s in sorted(reward)], color=f"C{i % 10}", lw=1.5, label=label(run_dir))
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean over the step's completions)")
    ax.set_title("GRPO rewards")
    _save(fig, ax, output)
    return
  curves = [(label(d), *read_curves(d)) for d in run_dirs]
  fig, ax = _figure(output)
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
  _save(fig, ax, output)


def _image_format(output: str) -> str:
  return os.path.splitext(output)[1][1:].lower() or "png"


def _figure(output: str):
  """A new figure and its axes, once ``output``'s extension names a format matplotlib writes."""
  fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
  formats = fig.canvas.get_supported_filetypes()
  if _image_format(output) not in formats:
    plt.close(fig)
    raise UsageError(f"--output {output}: matplotlib writes no .{_image_format(output)} images; use one of"
                     f" {', '.join('.' + f for f in sorted(formats))}")
  return fig, ax


def _save(fig, ax, output: str) -> None:
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  try:
    fig.savefig(output, format=_image_format(output))
  except OSError as e:
    raise UsageError(f"cannot write {output}: {e.strerror}; choose another --output") from None
  finally:
    plt.close(fig)


def _plot(argv: list[str] | None) -> None:
  parser = cli.Parser(prog="python -m train.plot",
                      description="Draw the train and validation loss of runs against tokens into an image.")
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of python -m train.gpt")
  parser.add_argument("--output", default="curves.png", help="the image to write, its format from the extension: .png, .pdf, .svg, ..."
                           " (default curves.png)")
  args = parser.parse_args(argv)
  plot(args.run_dirs, args.output)
  print(f"wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: _plot(argv))


if __name__ == "__main__":
  cli.exit(main())
