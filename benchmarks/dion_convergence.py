"""Dion's orthonormalization and power-iteration variants against each other: seeds x learning rates.

    python -m benchmarks.dion_convergence --preset tiny --steps 300 --seeds 0 1 2 \\
        --lrs 0.01 0.02 0.04 --variant cholesky="--dion-qr-method shifted_cqr" \\
        --variant polar="--dion-qr-method polar" --out benchmarks/results/dion_convergence_tiny

Each variant is a name and the ``python -m train.gpt`` flags that make it; every (variant,
lr, seed) is one run in a subprocess, one after the other, all on the embedded corpus with
the same steps and batch, evaluated once at the end. Run directories are
``RUNS_DIR/VARIANT-lrLR-sSEED``; one whose ``metrics.jsonl`` already holds the final
validation loss is read, not trained again, so an interrupted grid continues, and grids
run from different checkouts (today's code beside a branch) meet in one table. ``--seeds``
may be given per learning rate: ``--lrs 0.01:0 0.02 0.04:0`` trains 0.01 and 0.04 on seed
0 only (a pilot) and 0.02 on every seed of ``--seeds``.

The summary (``OUT.md``, ``OUT.json``): per variant and lr, the final validation loss of
each seed, their mean and spread (max − min); the best lr of a variant is the one of the
lowest mean over the seeds it ran on all of (a pilot lr counts by its seed-0 loss only
where no lr ran every seed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time

from train.cli import UsageError
from train.store.log import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def final_loss(run_dir: str, steps: int) -> float | None:
  try:
    _, valid = read_metrics(run_dir)
  except UsageError:
    return None
  return valid[steps]["val_loss"] if steps in valid else None


def train(flags: list[str], lr: float, seed: int, args, run_dir: str) -> float:
  cmd = [sys.executable, "-m", "train.gpt", "--preset", args.preset, "--data", "stdlib", "--optimizer", "dion",
         "--lr", repr(lr), "--seed", str(seed), "--steps", str(args.steps), "--eval-every", str(args.steps),
         "--save-every", "0", "--run-dir", run_dir, *shlex.split(args.common), *flags]
  print("$", shlex.join(cmd), flush=True)
  start = time.perf_counter()
  with open(run_dir + ".log", "w") as log:
    rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
  if rc:
    print(f"  exit code {rc}; see {run_dir}.log", flush=True)
  return time.perf_counter() - start


def summarize(losses: dict, variants: list[str], lrs: list[float], seeds: list[int]) -> tuple[str, dict]:
  """Markdown table and the best lr per variant (module docstring)."""
  lines = ["| variant | lr | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | spread | best |",
           "|---|---|" + "---|" * len(seeds) + "---|---|---|"]
  best = {}
  for name in variants:
    rows = []
    for lr in lrs:
      got = [losses.get((name, lr, s)) for s in seeds]
      done = [x for x in got if x is not None and math.isfinite(x)]
      if not done:
        continue
      complete = len(done) == len(seeds)
      rows.append((lr, got, statistics.mean(done), max(done) - min(done), complete))
    full = [r for r in rows if r[4]]
    pick = min(full or rows, key=lambda r: r[2]) if rows else None
    if pick:
      best[name] = {"lr": pick[0], "mean": pick[2], "spread": pick[3], "seeds": pick[1]}
    for lr, got, mean, spread, complete in rows:
      cells = " | ".join("-" if x is None else f"{x:.4f}" for x in got)
      lines.append(f"| {name} | {lr:g} | {cells} | {mean:.4f} | {spread:.4f} | {'*' if pick and lr == pick[0] else ''} |")
  return "\n".join(lines), best


def parse_lrs(specs: list[str], seeds: list[int]) -> list[tuple[float, list[int]]]:
  out = []
  for spec in specs:
    lr, _, only = spec.partition(":")
    out.append((float(lr), [int(s) for s in only.split(",")] if only else seeds))
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.dion_convergence", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--lrs", nargs="+", default=["0.01", "0.02", "0.04"], help="LR or LR:SEED,SEED,...")
  parser.add_argument("--variant", action="append", required=True, help='NAME="TRAIN.GPT FLAGS"')
  parser.add_argument("--common", default="", help="flags for every run (e.g. --num-layers 2 --seq-len 128)")
  parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "dion_convergence"))
  parser.add_argument("--out", help="OUT.md and OUT.json get the table (default: print only)")
  parser.add_argument("--no-train", action="store_true", help="only read finished runs")
  args = parser.parse_args(argv)
  variants = dict(v.split("=", 1) for v in args.variant)
  grid = parse_lrs(args.lrs, args.seeds)
  os.makedirs(args.runs_dir, exist_ok=True)
  losses, walls = {}, {}
  for name, flags in variants.items():
    for lr, seeds in grid:
      for seed in seeds:
        run_dir = os.path.join(args.runs_dir, f"{name}-lr{lr:g}-s{seed}")
        loss = final_loss(run_dir, args.steps)
        if loss is None and not args.no_train:
          walls[(name, lr, seed)] = train(shlex.split(flags), lr, seed, args, run_dir)
          loss = final_loss(run_dir, args.steps)
        losses[(name, lr, seed)] = loss
        print(f"  {name} lr={lr:g} seed={seed}: {loss}", flush=True)
  text, best = summarize(losses, list(variants), [lr for lr, _ in grid], args.seeds)
  print(text)
  if args.out:
    command = "python -m benchmarks.dion_convergence " + shlex.join(argv if argv is not None else sys.argv[1:])
    with open(args.out + ".md", "w") as f:
      f.write(f"`{command}`\n\n{text}\n\n* = best lr of the variant (lowest mean final validation loss).\n")
    with open(args.out + ".json", "w") as f:
      json.dump({"command": command, "variants": variants,
                 "runs": [{"variant": n, "lr": lr, "seed": s, "val_loss": v} for (n, lr, s), v in losses.items()],
                 "wall_s": {f"{n}-lr{lr:g}-s{s}": w for (n, lr, s), w in walls.items()},
                 "best": best}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
