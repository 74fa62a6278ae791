"""The GPU evidence's ``memory`` stage: each recompute policy's and the optimizer offload's
device and host memory per step, from the trainer's compiled step (``train/run/compiled.py``:
``memory_analysis()``, arguments + outputs - aliased + temporaries), and the step's time
against ``none``'s: the recompute's cost.

``small`` and ``350m`` in bfloat16 with cuDNN attention on one GPU (``--mesh fs=1``), a
batch of 8 sequences; the step timed as the trainer runs it (chained, donated,
``train.gpu.timing.throughput_time``) on random tokens. On a GPU, unlike XLA:CPU, the
offloaded tensors and state land in pinned host memory: these rows are the host figures
the CPU cannot give. ``python -m benchmarks.plan_memory --gpu-json gpu.json`` sets the
planner's memory beside each row (this command imports no other).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from models import remat
from train.gpu.timing import throughput_time
from train.run import compiled as compiled_lib

POLICIES = tuple(remat.POLICIES)
RUNS = (("small", 8), ("350m", 8))


def measure(argv: list[str], steps: int) -> dict:
  """The compiled step's memory for the trainer's flags ``argv``, and the step's seconds
  (``steps`` chained steps; 0: not run)."""
  step = compiled_lib.compile_step(argv)
  got = compiled_lib.footprint(step.compiled.memory_analysis())
  row = {"flags": " ".join(argv), "device_GiB": got.device / 2**30, "host_GiB": got.host / 2**30,
         "temporaries_GiB": got.temporaries / 2**30}
  if steps:
    rng = np.random.default_rng(0)
    batch = {k: jax.device_put(rng.integers(0, step.model_cfg.vocab_size, s.shape).astype(np.int32), s.sharding)
             for k, s in step.batch.items()}
    state = jax.tree.map(jnp.copy, step.state)
    row["ms_per_step"] = 1e3 * throughput_time(lambda st: (step.compiled(st, batch)[0],), (state,), steps)
  return row


def stage_memory(args, runs=RUNS, policies=POLICIES, offloads=(False, True),
                 extra: tuple[str, ...] = ("--dtype", "bfloat16", "--attention", "cudnn")) -> dict:
  rows, deadline = [], time.monotonic() + args.stage_seconds
  for preset, batch in runs:
    base = ["--preset", preset, "--mesh", "fs=1", "--global-batch-size", str(batch), *extra]
    for policy in policies:
      for offload in (("--offload-optimizer",) if off else () for off in offloads):
        if time.monotonic() > deadline:
          break
        try:
          row = measure([*base, "--remat", policy, *offload], args.train_steps)
        except Exception as e:  # noqa: BLE001  (a policy out of memory is a result)
          row = {"flags": " ".join([*base, "--remat", policy, *offload]), "error": f"{type(e).__name__}: {e}"[:500]}
        none = next((r for r in rows if r["preset"] == preset and r["policy"] == "none" and "ms_per_step" in r), None)
        if none and "ms_per_step" in row:
          row["time_over_none"] = row["ms_per_step"] / none["ms_per_step"]
        rows.append({"preset": preset, "policy": policy, "offload_optimizer": bool(offload), **row})
        print(line(rows[-1]), flush=True)
  return {"rows": rows, "complete": len(rows) == len(runs) * len(policies) * len(offloads)}


def line(row: dict) -> str:
  if "error" in row:
    return f"{row['preset']} {row['policy']}: {row['error']}"
  timing = f", {row['ms_per_step']:.1f} ms/step" if "ms_per_step" in row else ""
  return (f"{row['preset']} --remat {row['policy']}{' --offload-optimizer' if row['offload_optimizer'] else ''}:"
          f" device {row['device_GiB']:.2f} GiB, host {row['host_GiB']:.2f} GiB{timing}")


def markdown(result: dict) -> str:
  lines = ["| preset | --remat | offload | device GiB | host GiB | ms/step | / none |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    if "error" in r:
      lines.append(f"| {r['preset']} | {r['policy']} | {r['offload_optimizer']} | {r['error'][:80]} | | | |")
      continue
    lines.append(f"| {r['preset']} | {r['policy']} | {'yes' if r['offload_optimizer'] else 'no'}"
                 f" | {r['device_GiB']:.2f} | {r['host_GiB']:.2f} | {r.get('ms_per_step', float('nan')):.1f}"
                 f" | {r.get('time_over_none', float('nan')):.2f} |")
  return "\n".join(lines)
