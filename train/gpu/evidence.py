"""The GPU evidence's stages that run the trainer: ``train`` and ``profile`` (``python -m
train.gpu``'s docstring says what each measures), and the figure of every stage's results."""
from __future__ import annotations

import collections
import gzip
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp

from train.gpu import optimizers
from train.gpu.timing import donated_update, throughput_time

# --- train -------------------------------------------------------------------------


def optimizer_seconds(run, steps: int) -> float:
  """Seconds per call of the run's optimizer alone: update + apply, jitted with parameters
  and state donated, on copies of the run's parameters and gradients of their shapes,
  dtypes and shardings; timed as the trainer times its steps (chained calls, one wait)."""
  import models
  from train.run import optim

  with jax.set_mesh(run.mesh):
    params = jax.tree.map(jnp.copy, run.state.params)
    tx = optim.optimizer(run.cfg, params, run.mesh, models.param_specs(params))
    grads = jax.tree.map(lambda p: jax.device_put(
        jax.random.normal(jax.random.key(1), p.shape, p.dtype) * 1e-2, p.sharding), params)
    return throughput_time(donated_update(tx, grads), (params, tx.init(params)), steps)


def train_run(preset: str, optimizer: str, steps: int, batch: int, attention: str, optimizer_steps: int = 0,
              run_dir: str | None = None, profile_steps: str | None = None, overrides: dict | None = None) -> dict:
  """The trainer's numbers of the last log interval (after the compiling first one); with
  ``optimizer_steps``, also the optimizer's own time (:func:`optimizer_seconds`) and its
  share of the step. The run goes to ``run_dir`` (default a temporary directory), its
  ``--profile-steps`` trace (``train/store/profiling.py``) to RUN_DIR/profile; ``overrides``
  are more of ``train.run.config.Config``'s fields."""
  if run_dir is None:
    with tempfile.TemporaryDirectory() as run_dir:
      return train_run(preset, optimizer, steps, batch, attention, optimizer_steps, run_dir, profile_steps,
                       overrides)
  from train.run import config as config_lib
  from train.run import loop, setup
  from train.store import log

  cfg = config_lib.Config(
      preset=preset, optimizer=optimizer, dtype="bfloat16", attention=attention, steps=steps,
      log_interval=steps // 2, global_batch_size=batch, eval_tokens=0, save_every=0,
      run_dir=run_dir, mesh="fs=1", profile_steps=profile_steps, **(overrides or {}))
  cfg.check()
  run = setup.setup(cfg)
  optimizer_ms = optimizer_seconds(run, optimizer_steps) * 1e3 if optimizer_steps else None
  code = loop.train(run)
  if code:
    raise RuntimeError(f"the trainer exited with {code}")
  intervals, _ = log.read_metrics(run_dir)
  record = intervals[max(intervals)]
  stats = jax.devices()[0].memory_stats() or {}
  row = {"preset": preset, "optimizer": optimizer, "attention": attention, "global_batch": batch,
         "fp8": cfg.fp8, "seq_len": run.model_cfg.seq_len, "params_M": run.model_cfg.num_params() / 1e6,
         "ms_per_step": record["ms_per_step"], "tokens_per_s": record["tokens_per_s"],
         "tflops": record["tflops_per_device"], "mfu": record.get("mfu"),
         # The allocator's peak since the process started: runs go from small to large.
         "process_peak_memory_GiB": stats.get("peak_bytes_in_use", 0) / 2**30}
  if optimizer_ms is not None:
    row.update(optimizer_ms=optimizer_ms, optimizer_share=optimizer_ms / record["ms_per_step"])
  return row


TRAIN_RUNS = (("small", 32, ("adamw", "adamw fp8", "adamw fp8 delayed", "dion2", "muon", "dion", "dion fp8",
                             "dion fp8 delayed", "dion tf32x3")),
              ("350m", 16, ("adamw", "adamw fp8", "adamw fp8 delayed", "dion", "dion fp8", "dion tf32x3")),
              ("1b", 4, ("adamw", "adamw fp8", "dion", "dion fp8")))
# A run's name that is not an optimizer: its --optimizer and the flags that make it (as Config fields).
# "fp8": --fp8 (models/fp8.py), its MFU still against the dense bf16 peak, so that FP8's gain shows;
# "fp8 delayed": --fp8 delayed, whose casts read their scales from the amax histories.
VARIANTS = {"dion tf32x3": ("dion", {"dion_qr_precision": "tensorfloat32x3"}),
            "adamw fp8": ("adamw", {"fp8": "current"}), "dion fp8": ("dion", {"fp8": "current"}),
            "adamw fp8 delayed": ("adamw", {"fp8": "delayed"}), "dion fp8 delayed": ("dion", {"fp8": "delayed"})}


def train_line(row: dict) -> str:
  """One run of the train stage as a line of the log."""
  line = (f"  {row['preset']} {row['optimizer']}: {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s,"
          f" {row['tflops']:.1f} TFLOP/s, MFU {100 * (row['mfu'] or 0):.1f}%,"
          f" process peak {row['process_peak_memory_GiB']:.1f} GiB")
  if "optimizer_ms" in row:
    line += f"; optimizer {row['optimizer_ms']:.1f} ms ({100 * row['optimizer_share']:.1f}% of the step)"
  return line


def stage_train(args, runs=TRAIN_RUNS, attention: str = "cudnn") -> dict:
  rows, deadline = [], time.monotonic() + args.stage_seconds
  for preset, batch, names in runs:
    for name in names:
      if time.monotonic() > deadline:
        break
      optimizer, overrides = VARIANTS.get(name, (name, {}))
      rows.append({**train_run(preset, optimizer, args.train_steps, batch, attention,
                               optimizer_steps=args.train_steps, overrides=overrides), "optimizer": name})
      print(train_line(rows[-1]), flush=True)
  return {"rows": rows, "complete": len(rows) == sum(len(names) for _, _, names in runs)}


def summarize_trace(path: str, top: int = 25) -> list[dict]:
  """The device's kernels in a Perfetto trace (``jax.profiler``), by total time."""
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and "/device:" in e.get("args", {}).get("name", "")}
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices:
      total[e["name"]] += e["dur"]
      count[e["name"]] += 1
  all_us = sum(total.values())
  return [{"kernel": name[:120], "ms": us / 1e3, "count": count[name], "share": us / all_us}
          for name, us in total.most_common(top)]


def stage_profile(args, preset: str = "small", batch: int = 32, attention: str = "cudnn") -> dict:
  """The trainer's steps 2 to 6 of 6 traced by its own ``--profile-steps``, by kernel."""
  with tempfile.TemporaryDirectory() as run_dir:
    train_run(preset, "dion", 6, batch, attention, run_dir=run_dir, profile_steps="2:6")
    traces = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(run_dir, "profile")) for f in files
              if f.endswith("perfetto_trace.json.gz")]
    rows = summarize_trace(traces[0])
  for row in rows[:10]:
    print(f"  {row['ms']:9.1f} ms {row['count']:6d}x {100 * row['share']:5.1f}%  {row['kernel'][:80]}", flush=True)
  return {"rows": rows, "steps": "2:6", "what": f"{preset}, Dion at its default rank, batch {batch}, steps 2 to 6 of 6 (--profile-steps 2:6)"}


# --- output ------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ((left, small), (right, train)) = plt.subplots(2, 2, figsize=(16, 10))
  steps = results.get("optimizers", {}).get("rows", [])
  for name in optimizers.sweep_optimizers():
    points = [(r["n"], r[name]) for r in steps if isinstance(r.get(name), float)]
    if points:
      left.plot(*zip(*points), marker="o", label=name)
  left.set(xscale="log", yscale="log", xlabel="matrix size n (n x n)", ylabel="ms per optimizer step",
           title="optimizer step time vs matrix size")
  if steps:
    left.legend(fontsize=8)
  matrix_set = results.get("optimizers", {}).get("set", {})
  timed = [r for r in matrix_set.get("rows", []) if "ms" in r]
  small.barh(range(len(timed)), [r["ms"] for r in timed],
             color=["tab:blue" if r["implementation"] == "dion_jax" else "tab:red" for r in timed])
  small.set_yticks(range(len(timed)), [f"{r['implementation']} {r['optimizer']}" for r in timed], fontsize=8)
  for i, r in enumerate(timed):
    small.annotate(f" {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s", (r["ms"], i), va="center", fontsize=7)
  title = f"{matrix_set.get('preset')}'s {matrix_set.get('matrices')} matrices: dion_jax (blue), microsoft/dion (red)"
  small.set(xscale="log", xlabel="ms per step (update + apply)", title=title)
  if timed:
    small.set_xlim(right=4 * max(r["ms"] for r in timed))  # room for the labels
  kernels = [r for r in results.get("kernels", {}).get("rows", []) if "pallas" in r]
  labels = [f"{r['kernel'].split()[0]} {'x'.join(map(str, r['shape']))} {r['dtype'][:4]}" for r in kernels]
  right.barh(range(len(kernels)), [r["xla"] / r["pallas"] for r in kernels])
  right.axvline(1.0, color="k", lw=0.8)
  right.set_yticks(range(len(kernels)), labels, fontsize=7)
  right.set(xlabel="XLA time / Pallas time (>1: Pallas faster)", title="Pallas kernels against XLA")
  runs = results.get("train", {}).get("rows", [])
  labels = [f"{r['preset']} {r['optimizer']}" for r in runs]
  train.barh(range(len(runs)), [r["ms_per_step"] for r in runs], color="tab:gray", label="whole step")
  train.barh(range(len(runs)), [r.get("optimizer_ms", 0.0) for r in runs], color="tab:orange",
             label="optimizer alone (update + apply)")
  train.set_yticks(range(len(runs)), labels, fontsize=8)
  train.set(xlabel="ms per training step", title="training step and the optimizer's share")
  train.legend(fontsize=8)
  fig.suptitle(results["device"])
  fig.tight_layout()
  fig.savefig(path, dpi=100)
