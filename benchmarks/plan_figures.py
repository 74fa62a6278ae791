"""The planner's figures for Llama 3 shapes on one cluster (``train.plan``).

    python -m benchmarks.plan_figures --out benchmarks/results/plan

writes ``llama405b_table.md`` (per-step communication of Dion at ranks 1/4 and 1/16,
Muon and AdamW on one 405B mesh) and ``step_time_by_size.png`` (step time split into
compute, communication and pipeline bubble for Dion, Dion2, Muon and AdamW, 1B to
405B). Assumptions: 1024 H100s, 8 per node (tp=8 inside a node, every other axis on
InfiniBand), global batch 1024 sequences of 8192 tokens, micro-batches of one sequence,
bf16 compute at 50% of peak, nothing overlapped; each size on the mesh rp·fs·tp = 1024
with tp = 8 and the smallest fs whose AdamW run fits in HBM with remat.

It also writes the Dion paper's step-time-versus-matrix-size figure on one H100 as the
planner sees it, beside the H100's measurements (``train.gpu``'s optimizers stage,
``MEASURED``): ``optimizer_time_by_size.png`` and ``optimizer_time_by_size.md``. One n x n
float32 matrix on one device; the planner's update flops (``plan_optimizer.flops``) at
50% (its default ``--mfu``) of the matmuls' peak rate, or the update's HBM traffic at the
data sheet's bandwidth, whichever is slower (a roofline):

- Dion's matmuls (B Q, Bᵀ P, P Rᵀ, P Qᵀ: 8·n²·r) run in float32 at XLA's default precision,
  TF32 on Hopper: half the bf16 peak. Its orthonormalization of P is not counted.
- Muon's five Newton–Schulz steps (30·n³) run in bfloat16 at the bf16 peak.
- HBM traffic: the passes over n² elements that the update cannot avoid, in bytes per
  element (``BYTES_PER_ELEMENT``); the n x r factors are left out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jax.sharding import PartitionSpec as P

from train.run.plan import model as plan_model
from train.run.plan import optimizer as plan_optimizer
from train.run.plan import planner as plan

DEVICES, BATCH, SIZES = 1024, 1024, ("1b", "8b", "70b", "405b")
COMMON = dict(global_batch=BATCH, micro=1, gpu="h100", compare=False)


def mesh_for(model: str) -> str:
  """tp=8 and the smallest fs (powers of two) on which AdamW fits with remat, with the
  smallest cp that lets it (405B's float32 layer inputs, 126 x 8192 x 16384, fit no fs)."""
  for cp in (1, 2, 4, 8):
    for fs in (1, 2, 4, 8, 16, 32, 64, 128):
      if fs * cp * 8 > DEVICES:
        break
      mesh = f"rp={DEVICES // 8 // fs // cp},fs={fs}" + (f",cp={cp}" if cp > 1 else "") + ",tp=8"
      if plan.plan(model, mesh, "adamw", remat="full", **COMMON)["fits"]:
        return mesh
  raise ValueError(f"{model} fits no mesh rp·fs·cp·tp={DEVICES} with tp=8")


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
                 f" | {(p['memory']['device']['optimizer_state'] + p['memory']['host']['optimizer_state']) / 2**30:.1f} |")
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


MEASURED = os.path.join("benchmarks", "results", "gpu", "nvidia-h100-80gb-hbm3", "gpu.json")
# label, the measurement's column, the planner's optimizer and rank, the matmuls' rate (of bf16 peak)
SIZE_CURVES = (("Dion r=1", "dion r=1", "dion", 1.0, 0.5), ("Dion r=1/4", "dion r=1/4", "dion", 0.25, 0.5),
               ("Dion r=1/16", "dion r=1/16", "dion", 1 / 16, 0.5), ("Muon", "muon", "muon", 1.0, 1.0),
               ("AdamW", "optax adamw", "adamw", 1.0, 1.0))
BYTES_PER_ELEMENT = {
    # float32: momentum + gradient -> momentum (12), B Q and Bᵀ P read it (8), error feedback
    # rewrites it (8), the weight read and written (8)
    "dion": 36,
    # float32 momentum as Dion's (12), its bfloat16 copy (6), five Newton–Schulz steps each
    # reading and writing X, X Xᵀ, its square and the product in bfloat16 (5 x 18), the
    # weight read and written with the bfloat16 update (10)
    "muon": 118,
    # float32 weight, gradient, first and second moments read (16); weight and moments written (12)
    "adamw": 28,
}


def predicted_ms(optimizer: str, rank_fraction: float, n: int, rate: float, gpu: str = "h100",
                 mfu: float = 0.5) -> float:
  """The planner's time of one update of one n x n float32 matrix on one device (the
  module docstring's roofline); ``rate`` is the matmuls' peak as a fraction of bf16's."""
  leaf = plan_model.Leaf("w", (n, n), P(None, None), "dion")
  flops = plan_optimizer.flops([leaf], plan_model.sizes_of(""), optimizer, rank_fraction)
  hw = plan.GPUS[gpu]
  return 1e3 * max(flops / (hw.peak_flops * rate * mfu), BYTES_PER_ELEMENT[optimizer] * n * n / hw.hbm_bandwidth)


def size_rows(measured: dict) -> list[dict]:
  """Predicted and measured ms per (optimizer, n) where the measurement has a number."""
  rows = []
  for label, column, optimizer, rank, rate in SIZE_CURVES:
    for row in measured["optimizers"]["rows"]:
      if isinstance(row.get(column), float):
        predicted = predicted_ms(optimizer, rank, row["n"], rate)
        rows.append({"optimizer": label, "n": row["n"], "predicted_ms": predicted, "measured_ms": row[column],
                     "ratio": row[column] / predicted})
  return rows


def size_table(rows: list[dict], measured: dict) -> str:
  lines = [f"One n x n float32 matrix, one update + apply on one {measured['device']} (ms): the planner's"
           f" roofline against `train.gpu`'s optimizers stage ({measured['date']}, jax {measured['jax']}).", "",
           "| optimizer | n | planned ms | measured ms | measured / planned |", "| --- | --- | --- | --- | --- |"]
  lines += [f"| {r['optimizer']} | {r['n']} | {r['predicted_ms']:.3g} | {r['measured_ms']:.3g} | {r['ratio']:.2f} |"
            for r in rows]
  return "\n".join(lines)


def size_figure(rows: list[dict], measured: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5.5))
  for (label, *_), color in zip(SIZE_CURVES, ("tab:blue", "tab:cyan", "tab:green", "tab:red", "tab:gray")):
    mine = [r for r in rows if r["optimizer"] == label]
    ns = [r["n"] for r in mine]
    ax.plot(ns, [r["predicted_ms"] for r in mine], "--", color=color, label=f"{label}, planned")
    ax.plot(ns, [r["measured_ms"] for r in mine], "o-", color=color, label=f"{label}, measured")
  ax.set(xscale="log", yscale="log", xlabel="matrix size n (n x n, float32)", ylabel="ms per optimizer update")
  ax.set_title(f"Optimizer update vs matrix size, one {measured['device']}\n"
               "planned (dashed): 50% of peak flops (Dion TF32, Muon bf16) or HBM traffic", fontsize=10)
  sizes = sorted({r["n"] for r in rows})
  ax.set_xticks(sizes, [str(n) for n in sizes])
  ax.minorticks_off()
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_figures", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="directory for the tables (.md) and figures (.png)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  table = table_405b(mesh_for("405b"))
  with open(os.path.join(args.out, "llama405b_table.md"), "w") as f:
    f.write(table + "\n")
  print(table)
  figure(os.path.join(args.out, "step_time_by_size.png"))
  with open(MEASURED) as f:
    measured = json.load(f)
  rows = size_rows(measured)
  table = size_table(rows, measured)
  with open(os.path.join(args.out, "optimizer_time_by_size.md"), "w") as f:
    f.write(table + "\n")
  print(table)
  size_figure(rows, measured, os.path.join(args.out, "optimizer_time_by_size.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
