"""The Dion paper's communication figure, from compiled trainer steps and from the planner.

    python -m benchmarks.comm_figure --out benchmarks/results/comm

The bytes each device sends per optimizer step over the replicas' axis rp (ring
algorithms' wire bytes of every collective whose group spans rp), against Dion's rank
fraction (1, 1/2, 1/4, 1/8, 1/16), beside Muon, NorMuon, Dion2 (fraction 1/4) and AdamW,
which have no rank:

- compiled: ``python -m train.gpt``'s step as ``train.run.setup.setup`` compiles it (forward,
  backward, clipping, guard, update; ``train.run.comm``'s record, loops counted per run), for
  ``tiny`` with a global batch of 8 on 8 CPU devices, meshes rp=8 and rp=4,fs=2;
- planned: ``train.plan`` for Llama 3 8B and 70B on 1024 H100s (8 per node, tp=8,
  the smallest fs on which AdamW fits: ``benchmarks.plan_figures.mesh_for``), a batch of
  1024 sequences of 8192 tokens.

Writes ``replica_bytes.png``, ``replica_bytes.json`` and ``replica_bytes.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks import harness

RANKS = (1.0, 0.5, 0.25, 0.125, 0.0625)
OTHERS = {"muon": "Muon", "normuon": "NorMuon", "dion2": "Dion2 (1/4)", "adamw": "AdamW"}
COMPILED_MESHES = ("rp=8", "rp=4,fs=2")
PLANNED_MODELS = ("8b", "70b")


def compiled_over_rp(mesh: str, optimizer: str, rank: float = 0.25) -> int:
  """Wire bytes per device and step over rp of the trainer's compiled ``tiny`` step."""
  from train.run import config as config_lib
  from train.run import setup

  with tempfile.TemporaryDirectory(prefix="comm_figure_") as run_dir:
    cfg = config_lib.parse(["--preset", "tiny", "--mesh", mesh, "--optimizer", optimizer, "--global-batch-size", "8",
                            "--dion-rank-fraction", repr(rank), "--eval-tokens", "0", "--run-dir", run_dir])
    run = setup.setup(cfg)
    run.directory.close()
  by_axes = run.record["communication"]["bytes_per_device_and_step"]
  return sum(b["wire"] for axes, b in by_axes.items() if "rp" in axes.split(","))


def planned_over_rp(model: str, mesh: str, optimizer: str, rank: float = 0.25) -> int:
  """Wire bytes per device and step over rp of the planner's step (ring algorithms)."""
  from benchmarks import plan_figures
  from train.run.plan import model as plan_model
  from train.run.plan import planner as plan

  p = plan.plan(model, mesh, optimizer, rank, **plan_figures.COMMON)
  sizes = plan_model.sizes_of(mesh)
  return int(sum(plan.wire_bytes_and_steps(c["op"], c["bytes"], plan_model.group(sizes, tuple(c["axes"])))[0]
                 for c in p["collectives"] if "rp" in c["axes"]))


def measure() -> dict:
  from benchmarks import plan_figures

  setups = [("compiled", mesh, "tiny", lambda o, r, m=mesh: compiled_over_rp(m, o, r)) for mesh in COMPILED_MESHES]
  setups += [("planned", plan_figures.mesh_for(model), model, lambda o, r, m=model: planned_over_rp(
      m, plan_figures.mesh_for(m), o, r)) for model in PLANNED_MODELS]
  out = []
  for source, mesh, model, over_rp in setups:
    row = {"source": source, "model": model, "mesh": mesh,
           "dion": {f"{r:g}": over_rp("dion", r) for r in RANKS},
           **{o: over_rp(o, 0.25) for o in OTHERS}}
    print(json.dumps(row), flush=True)
    out.append(row)
  return {"ranks": RANKS, "panels": out}


def table(result: dict) -> str:
  ranks = [f"{r:g}" for r in result["ranks"]]
  head = "| source | model | mesh | " + " | ".join(f"Dion {r}" for r in ranks) + " | " + " | ".join(OTHERS.values()) + " |"
  lines = ["Bytes each device sends over rp per step (MB on the wire, ring algorithms); in brackets, over AdamW's.",
           "", head, "|" + " --- |" * (3 + len(ranks) + len(OTHERS))]
  for p in result["panels"]:
    adamw = p["adamw"]
    cells = [f"{p['dion'][r] / 1e6:,.3f} ({p['dion'][r] / adamw:.3f}x)" for r in ranks]
    cells += [f"{p[o] / 1e6:,.3f} ({p[o] / adamw:.3f}x)" for o in OTHERS]
    lines.append(f"| {p['source']} | {p['model']} | {p['mesh']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def draw(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = result["panels"]
  fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
  ranks = result["ranks"]
  styles = {"muon": ":", "normuon": "-.", "dion2": (0, (5, 2)), "adamw": "--"}
  for ax, p in zip(axes, panels):
    ax.plot(ranks, [p["dion"][f"{r:g}"] / 2**20 for r in ranks], "o-", color="C0", label="Dion")
    levels: dict[int, list[str]] = {}  # the others without a rank; equal ones share a line
    for o in OTHERS:
      levels.setdefault(p[o], []).append(o)
    for i, (level, names) in enumerate(levels.items()):
      ax.axhline(level / 2**20, linestyle=styles[names[-1]], color=f"C{i + 1}",
                 label=" = ".join(OTHERS[o] for o in names))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, ["1", "1/2", "1/4", "1/8", "1/16"])
    ax.invert_xaxis()
    ax.set_xlabel("Dion's rank fraction")
    ax.set_title(f"{p['model']}, {p['mesh']} ({p['source']})", fontsize=9)
    ax.set_ylim(bottom=0)
  axes[0].set_ylabel("MiB sent over rp per device and step")
  axes[-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.comm_figure", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  harness.add_out(parser, "benchmarks/results/comm", "the figure and its table")
  args = parser.parse_args(argv)
  harness.setup_process(cpu_devices=8, platform="cpu")
  result = measure()
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "replica_bytes.json"), "w") as f:
    json.dump(result, f, indent=1)
  text = table(result)
  with open(os.path.join(args.out, "replica_bytes.md"), "w") as f:
    f.write(f"# Bytes over the replicas per step\n\n`python -m benchmarks.comm_figure --out {args.out}`\n\n{text}\n")
  draw(result, os.path.join(args.out, "replica_bytes.png"))
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
