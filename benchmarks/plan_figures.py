"""The planner's figures for Llama 3 shapes on one cluster (``benchmarks.plan``).

    python -m benchmarks.plan_figures --out benchmarks/results/plan

writes ``llama405b_table.md`` (per-step communication of Dion at ranks 1/4 and 1/16,
Muon and AdamW on one 405B mesh) and ``step_time_by_size.png`` (step time split into
compute, communication and pipeline bubble for Dion, Dion2, Muon and AdamW, 1B to
405B). Assumptions: 1024 H100s, 8 per node (tp=8 inside a node, every other axis on
InfiniBand), global batch 1024 sequences of 8192 tokens, micro-batches of one sequence,
bf16 compute at 50% of peak, nothing overlapped; each size on the mesh rp·fs·tp = 1024
with tp = 8 and the smallest fs whose AdamW run fits in HBM with remat.
"""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks import plan

DEVICES, BATCH, SIZES = 1024, 1024, ("1b", "8b", "70b", "405b")
COMMON = dict(global_batch=BATCH, micro=1, gpu="h100", compare=False)


def mesh_for(model: str) -> str:
  """tp=8 and the smallest fs (powers of two) on which AdamW fits with remat."""
  for fs in (1, 2, 4, 8, 16, 32, 64, 128):
    mesh = f"rp={DEVICES // 8 // fs},fs={fs},tp=8"
    if plan.plan(model, mesh, "adamw", **COMMON)["fits"]:
      return mesh
  raise ValueError(f"{model} fits no mesh rp·fs·tp={DEVICES} with tp=8")


def table_405b(mesh: str) -> str:
  rows = [("Dion, rank 1/4", "dion", 0.25), ("Dion, rank 1/16", "dion", 1 / 16), ("Muon", "muon", 0.25),
          ("AdamW", "adamw", 0.25)]
  lines = [f"Llama 3 405B on {mesh} ({DEVICES} H100), batch {BATCH} x 8192, per device and step:", "",
           "| optimizer | over rp: GiB | all axes: GiB | of which optimizer: GiB | communication s | step s | state GiB |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for label, optimizer, rank in rows:
    p = plan.plan("405b", mesh, optimizer, rank, **COMMON)
    over_rp = sum(c["bytes"] for c in p["collectives"] if "rp" in c["axes"])
    update = sum(c["bytes"] for c in p["collectives"] if c["purpose"].startswith(("dion", "orthogonal", "normuon", "replica")))
    lines.append(f"| {label} | {over_rp / 2**30:,.2f} | {p['bytes_total'] / 2**30:,.1f} | {update / 2**30:,.2f}"
                 f" | {p['time']['communication']:.1f} | {p['time']['step']:.1f}"
                 f" | {p['memory']['optimizer_state'] / 2**30:.1f} |")
  return "\n".join(lines)


def figure(path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  optimizers = ("dion", "dion2", "muon", "adamw")
  parts = (("compute", "tab:blue"), ("communication", "tab:orange"), ("bubble", "tab:gray"))
  fig, axes = plt.subplots(1, len(SIZES), figsize=(12, 4))
  for ax, model in zip(axes, SIZES):
    mesh, top = mesh_for(model), 0.0
    for j, optimizer in enumerate(optimizers):
      t = plan.plan(model, mesh, optimizer, **COMMON)["time"]
      bottom = 0.0
      for part, color in parts:
        ax.bar(j, t[part], 0.8, bottom=bottom, color=color, label=part)
        bottom += t[part]
      top = max(top, bottom)
    ax.set_ylim(0, 1.08 * top)
    ax.set_xticks(range(len(optimizers)), optimizers)
    ax.set_title(f"Llama 3 {model.upper()}\n{mesh}", fontsize=9)
    ax.set_ylabel("seconds per step" if model == SIZES[0] else None)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles[:len(parts)], labels[:len(parts)], loc="lower center", ncol=len(parts))
  fig.suptitle(f"Planned step time on {DEVICES} H100 (8 per node), batch {BATCH} x 8192 (no pipeline: no bubble)")
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_figures", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="directory for llama405b_table.md and step_time_by_size.png")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  table = table_405b(mesh_for("405b"))
  with open(os.path.join(args.out, "llama405b_table.md"), "w") as f:
    f.write(table + "\n")
  print(table)
  figure(os.path.join(args.out, "step_time_by_size.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
