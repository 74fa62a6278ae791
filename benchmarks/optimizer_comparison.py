"""Dion against Muon, AdamW and Lion on a GPT preset: a small learning-rate sweep each.

    python -m benchmarks.optimizer_comparison --steps 200 --lrs-scale 0.5 1 2

Trains a preset (``--preset``, default ``tiny``) on the embedded corpus (``--data stdlib``) with every optimizer
of ``--optimizers`` at the trainer's default learning rate times each ``--lrs-scale``,
all with the same steps, batch, sequence length and seed, hence the same tokens in the
same order. Each run is ``python -m train.gpt`` in a subprocess, one after the other
(timings on a shared CPU would mean little otherwise). Then it reads each run's
``metrics.jsonl`` and prints a table: optimizer, lr, final validation lm loss, wall time
of the subprocess (start-up, compilation and evaluation included) and training tokens/s
(the median over the log intervals after the first, which holds the compilation); picks
per optimizer the lr of the lowest final validation loss; draws the best runs with
``python -m train.plot`` into ``OUT_DIR/optimizer_comparison.png``; and writes the table
to ``OUT_DIR/optimizer_comparison.{json,md}``.

Optimizer names: ``dion`` (``--dion-rank-fraction 1``), ``dion-1/2`` and ``dion-1/4`` (rank
fractions 0.5 and 0.25), ``dion2`` (fraction 1/4), ``nordion2`` (fraction 1/4), ``normuon``, ``muon``, ``adamw``, ``lion``. A name may carry its own scales,
``dion-1/4:0.5,1,2``, to spend a tight budget where it matters; the rest use
``--lrs-scale``. The run directories (checkpoints included, outside OUT_DIR by default)
are kept; with ``--reuse`` a run whose ``metrics.jsonl`` already holds its final
validation loss is not trained again, so an interrupted sweep continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from train.cli import UsageError
from train.run.config import DEFAULT_LR
from train.store.log import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (trainer optimizer, extra trainer flags)
OPTIMIZERS = {
    "dion": ("dion", ["--dion-rank-fraction", "1"]),
    "dion-1/2": ("dion", ["--dion-rank-fraction", "0.5"]),
    "dion-1/4": ("dion", ["--dion-rank-fraction", "0.25"]),
    "dion2": ("dion2", []),
    "nordion2": ("nordion2", []),
    "normuon": ("normuon", []),
    "muon": ("muon", []),
    "adamw": ("adamw", []),
    "lion": ("lion", []),
}


def parse_optimizer(spec: str, default_scales: list[float]) -> tuple[str, list[float]]:
  name, _, scales = spec.partition(":")
  if name not in OPTIMIZERS:
    raise SystemExit(f"error: unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
  return name, ([float(s) for s in scales.split(",")] if scales else default_scales)


def run_name(name: str, lr: float) -> str:
  return f"{name.replace('/', '_')}-lr{lr:g}"


def read_run(run_dir: str, steps: int) -> dict | None:
  """The run's final validation loss and median tokens/s, or None when it did not finish."""
  try:
    intervals, val = read_metrics(run_dir)
  except UsageError:  # nothing logged yet, or a line cut short by a kill
    return None
  if steps not in val:
    return None
  train = list(intervals.values())
  rates = [r["tokens_per_s"] for r in train[1:]] or [r["tokens_per_s"] for r in train]
  return {"val_loss": val[steps]["val_loss"], "final_train_loss": train[-1]["loss"] if train else None,
          "tokens_per_s": statistics.median(rates) if rates else None,
          "tokens": train[-1]["tokens"] if train else None,
          "skipped": train[-1]["skipped"] if train else None}


def train(name: str, lr: float, args, run_dir: str) -> float:
  """Trains one run in a subprocess; returns its wall time in seconds."""
  optimizer, extra = OPTIMIZERS[name]
  shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start clean
  cmd = [sys.executable, "-m", "train.gpt", "--preset", args.preset, "--data", "stdlib",
         "--optimizer", optimizer, "--lr", repr(lr), *extra, "--steps", str(args.steps),
         "--eval-every", str(args.steps), "--save-every", "0", "--seed", str(args.seed),
         "--run-dir", run_dir, *args.extra]
  print("$", " ".join(cmd), flush=True)
  start = time.perf_counter()
  with open(os.path.join(os.path.dirname(run_dir), run_name(name, lr) + ".log"), "w") as log:
    rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
  seconds = time.perf_counter() - start
  if rc:
    print(f"  exit code {rc}; see {log.name}", flush=True)
  return seconds


def table(rows: list[dict]) -> str:
  lines = ["| optimizer | lr | final val loss | wall time (s) | tokens/s | best |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    loss = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "failed"
    rate = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
    wall = f"{r['wall_s']:.0f}" if r["wall_s"] is not None else "-"
    lines.append(f"| {r['optimizer']} | {r['lr']:g} | {loss} | {wall} | {rate} | {'*' if r['best'] else ''} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_comparison",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny", help="the model preset of every run (default tiny)")
  parser.add_argument("--steps", type=int, default=200, help="optimizer steps of every run (default 200)")
  parser.add_argument("--lrs-scale", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                      help="multiples of the trainer's default lr to sweep (default 0.5 1 2)")
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                      help="NAME or NAME:S1,S2,... with NAME in " + ", ".join(OPTIMIZERS)
                      + " (default all, each with --lrs-scale)")
  parser.add_argument("--out-dir", default=os.path.join("runs", "benchmarks"),
                      help="where the PNG, JSON and markdown table go (default runs/benchmarks; the"
                           " repository's committed ones are in benchmarks/results: pass --out-dir"
                           " benchmarks/results to replace them)")
  parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "optimizer_comparison"),
                      help="run directories and logs (default runs/optimizer_comparison)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--reuse", action="store_true", help="keep finished runs instead of training them again")
  parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                      help="further python -m train.gpt flags for every run (last on the line)")
  args = parser.parse_args(argv)
  sweeps = [parse_optimizer(s, args.lrs_scale) for s in args.optimizers]
  os.makedirs(args.out_dir, exist_ok=True)
  os.makedirs(args.runs_dir, exist_ok=True)
  walls_path = os.path.join(args.runs_dir, "wall_times.json")
  walls = json.load(open(walls_path)) if args.reuse and os.path.isfile(walls_path) else {}

  rows = []
  for name, scales in sweeps:
    for scale in scales:
      lr = DEFAULT_LR[OPTIMIZERS[name][0]] * scale
      run_dir = os.path.join(args.runs_dir, run_name(name, lr))
      result = read_run(run_dir, args.steps) if args.reuse else None
      if result is None:
        walls[run_name(name, lr)] = train(name, lr, args, run_dir)
        with open(walls_path, "w") as f:
          json.dump(walls, f, indent=1)
        result = read_run(run_dir, args.steps)
      row = {"optimizer": name, "lr": lr, "lr_scale": scale, "run_dir": run_dir,
             "wall_s": walls.get(run_name(name, lr)), "val_loss": None, "tokens_per_s": None,
             "final_train_loss": None, "skipped": None, "best": False}
      row.update(result or {})
      rows.append(row)
      print(f"  {name} lr={lr:g}: val loss {row['val_loss']}, wall {row['wall_s']} s,"
            f" tokens/s {row['tokens_per_s']}", flush=True)

  best = {}
  for r in rows:
    if r["val_loss"] is not None and (r["optimizer"] not in best or r["val_loss"] < best[r["optimizer"]]["val_loss"]):
      best[r["optimizer"]] = r
  for r in best.values():
    r["best"] = True
  # A best lr at the edge of its sweep may not be the optimum.
  edge = [n for n, r in best.items() if len({x["lr"] for x in rows if x["optimizer"] == n}) > 1
          and r["lr"] in (min(x["lr"] for x in rows if x["optimizer"] == n),
                          max(x["lr"] for x in rows if x["optimizer"] == n))]

  text = table(rows)
  print(text)
  summary = sorted(best.values(), key=lambda r: r["val_loss"])
  print("best per optimizer, by final validation loss: "
        + ", ".join(f"{r['optimizer']} {r['val_loss']:.4f} (lr {r['lr']:g})" for r in summary))
  if edge:
    print("best lr at the edge of its sweep (widen it to be sure): " + ", ".join(edge))
  command = "python -m benchmarks.optimizer_comparison " + " ".join(argv if argv is not None else sys.argv[1:])
  with open(os.path.join(args.out_dir, "optimizer_comparison.json"), "w") as f:
    json.dump({"command": command, "steps": args.steps, "preset": args.preset, "data": "stdlib",
               "runs": [{k: v for k, v in r.items() if k != "run_dir"} for r in rows],
               "best": [{"optimizer": r["optimizer"], "lr": r["lr"], "val_loss": r["val_loss"]} for r in summary],
               "best_at_sweep_edge": edge}, f, indent=1)
  with open(os.path.join(args.out_dir, "optimizer_comparison.md"), "w") as f:
    f.write(f"# Optimizer comparison: {args.preset} GPT, embedded corpus, {args.steps} steps\n\n"
            f"`{command}`\n\n{text}\n\n* = best lr of its optimizer by final validation lm loss.\n")
    if edge:
      f.write(f"Best lr at the edge of its sweep: {', '.join(edge)}.\n")
  if summary:
    png = os.path.join(args.out_dir, "optimizer_comparison.png")
    subprocess.run([sys.executable, "-m", "train.plot", *[r["run_dir"] for r in summary], "--output", png],
                   cwd=REPO, check=True)
  return 0 if len(best) == len(sweeps) else 1


if __name__ == "__main__":
  sys.exit(main())
