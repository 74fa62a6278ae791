"""GPU evidence in one command: kernels, optimizer steps and training, as JSON and a PNG.

    python -m benchmarks.gpu                     # every stage, about 7 minutes on one H100
    python -m benchmarks.gpu --stages check,kernels --out /tmp/gpu

Stages (``--stages``); each reports, and the next runs even when one fails:

- ``check``: every Pallas kernel (RCQR's sketch, solve + Gram and solve; Newton–Schulz's
  symmetric products) and the whole RCQR and polar factor, Pallas and XLA, against
  float64 NumPy on the same inputs (the sketch's S from ``dion_jax.kernels.sketch.sketch_block``).
- ``kernels``: time of the Pallas path against XLA's composition of the same math
  (and Householder QR for RCQR), interleaved rounds.
- ``optimizers``: one jitted step (update + apply) on one square n x n float32 matrix,
  n = 2048, 4096, ... while the stage's time lasts: Dion at rank 1, 1/4 and 1/16, Dion2
  (fraction 1/4), NorMuon and Muon (bf16 Polar Express), optax's Muon and AdamW; the
  Dion paper's step-time-versus-size figure. A size that runs out of memory is recorded.
- ``train``: the trainer (``python -m train.gpt``) on ``small`` and ``350m`` in bfloat16
  with cuDNN attention, AdamW and Dion: tokens/s, model TFLOP/s, MFU against the
  device's dense bf16 peak and peak memory, from the last log interval.

- ``profile``: a trace of a few Dion steps of ``small`` (``jax.profiler``), summarized as
  the device's kernels by total time: where a step's time goes.

Writes ``gpu.json`` after every stage and ``gpu.png`` at the end, under ``--out``
(default ``benchmarks/results/gpu/<device>/``). Without a GPU it says so and exits 2.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dion_jax
from benchmarks.harness import interleaved_times, jitted_step, time_fn
from dion_jax.kernels import newton_schulz, newton_schulz_xla, rcqr_xla, sketch
from dion_jax.kernels import rcqr as pallas_rcqr
from dion_jax.linalg import polar, qr

EXIT_NO_GPU = 2
STAGES = ("check", "kernels", "optimizers", "train", "profile")
# Relative error bounds against float64 on the same (already rounded) inputs: float32
# kernels multiply in TF32x3; bfloat16 ones round their output (and A before A²) to bf16.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def _rel(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# --- check -------------------------------------------------------------------------


def _conditioned(m: int, r: int, dtype, seed: int) -> jax.Array:
  rng = np.random.default_rng(seed)
  P = rng.standard_normal((m, r)) * np.logspace(0, -3, r)  # condition number about 1e3
  return jnp.asarray(P, dtype)


def _check_rcqr(m: int, r: int, dtype) -> list[dict]:
  P = _conditioned(m, r, dtype, seed=m + r)
  P64, k, seed, start = _f64(P), sketch.sketch_size(r, 1.25), jnp.uint32(7), jnp.uint32(0)
  S64 = _f64(sketch.sketch_block(seed, start, m, k))
  R64 = np.linalg.qr(S64 @ P64, mode="r")
  R = jnp.asarray(R64, jnp.float32)
  P1_64 = np.linalg.solve(R64.T, P64.T).T
  passes = {  # name: (pallas, xla, arguments, float64 reference)
      "rcqr sketch": (lambda *a: pallas_rcqr.sketch_product(*a, k, start),
                      lambda *a: rcqr_xla.xla_sketch_product(*a, k, start), (P, seed), S64 @ P64),
      "rcqr solve": (pallas_rcqr.solve, rcqr_xla.xla_solve, (P, R), P1_64),
      "rcqr gram": (lambda *a: pallas_rcqr.solve_and_gram(*a)[1],
                    lambda *a: rcqr_xla.xla_solve_and_gram(*a)[1], (P, R), P1_64.T @ P1_64),
  }
  name = jnp.dtype(dtype).name
  rows = []
  for kernel, (pallas, xla, arguments, ref) in passes.items():
    errors = {b: _rel(jax.jit(f)(*arguments), ref) for b, f in (("pallas", pallas), ("xla", xla))}
    rows.append({"kernel": kernel, "shape": [m, r], "dtype": name, **errors})
  for backend in ("pallas", "xla"):  # the whole RCQR: orthonormal, and spanning P
    Q = _f64(jax.jit(functools.partial(qr.rcqr, backend=backend))(P, seed))
    rows.append({"kernel": "rcqr orthonormality", "backend": backend, "shape": [m, r], "dtype": name,
                 backend: float(np.max(np.abs(Q.T @ Q - np.eye(r))))})
    rows.append({"kernel": "rcqr span", "backend": backend, "shape": [m, r], "dtype": name,
                 backend: float(np.linalg.norm(P64 - Q @ (Q.T @ P64)) / np.linalg.norm(P64))})
  return rows


def _polar64(G: np.ndarray, method: str) -> np.ndarray:
  """The same odd quintic iteration as ``dion_jax.polar`` in float64, G (b, m, n) wide or tall."""
  coefficients, safety = polar.METHODS[method]
  tall = G.shape[-2] > G.shape[-1]
  X = np.swapaxes(G, -1, -2) if tall else G
  X = X / (np.sqrt(np.sum(X * X, axis=(-2, -1), keepdims=True)) * safety + 1e-8)
  for a, b, c in coefficients:
    A = X @ np.swapaxes(X, -1, -2)
    X = a * X + (b * A + c * A @ A) @ X
  return np.swapaxes(X, -1, -2) if tall else X


def _check_newton_schulz(b: int, s: int, l: int, dtype) -> list[dict]:
  X = jnp.asarray(np.random.default_rng(s).standard_normal((b, s, l)) / np.sqrt(l), dtype)
  X64, (_, cb, cc) = _f64(X), polar.POLAR_EXPRESS[1]
  A64 = X64 @ np.swapaxes(X64, 1, 2)
  ref = cb * A64 + cc * A64 @ A64
  name = jnp.dtype(dtype).name
  precision = jax.lax.Precision.HIGHEST if name == "float32" else None
  products = {"pallas": newton_schulz.symmetric_products, "xla": newton_schulz_xla.xla_symmetric_products}
  rows = [{"kernel": "ns symmetric products", "shape": [b, s, l], "dtype": name,
           **{k: _rel(jax.jit(lambda x, f=f: f(x, cb, cc, precision))(X), ref) for k, f in products.items()}}]
  polar64 = _polar64(X64, "polar_express")
  rows.append({"kernel": "polar factor", "shape": [b, s, l], "dtype": name, **{
      backend: _rel(jax.jit(functools.partial(polar.polar_factor, dtype=dtype, backend=backend))(X), polar64)
      for backend in ("pallas", "xla")}})
  return rows


def stage_check(args) -> dict:
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    for m, r in ((8192, 512), (4096, 128), (1000, 24)):
      rows += _check_rcqr(m, r, dtype)
    for b, s, l in ((2, 1024, 4096), (3, 200, 500)):
      rows += _check_newton_schulz(b, s, l, dtype)
  for row in rows:
    tol = TOLERANCE[row["dtype"]]
    if row["kernel"] in ("rcqr orthonormality", "rcqr span"):
      tol = 1e-4  # RCQR runs in float32 whatever P's dtype
    if row["kernel"] == "polar factor":
      # Five bf16 steps compound their rounding far past one product's: there the kernel
      # must be as close to float64 as XLA's bf16 composition is (about 8e-2 on CPU).
      tol = 1.5 * row["xla"] + 1e-3 if row["dtype"] == "bfloat16" else 1e-3
    row["tolerance"] = tol
    if "pallas" in row:
      row["pallas_ok"] = bool(row["pallas"] <= tol)
    print(f"  {row['kernel']:22s} {str(row['shape']):18s} {row['dtype']:8s}"
          + "".join(f" {k} {row[k]:.2e}" for k in ("pallas", "xla") if k in row) + f" (tol {tol:g})", flush=True)
  failed = [r for r in rows if r.get("pallas_ok") is False]
  return {"rows": rows, "pallas_failures": len(failed)}


# --- kernels -----------------------------------------------------------------------


def stage_kernels(args) -> dict:
  rows, deadline = [], time.monotonic() + args.stage_seconds
  rcqr_cases = [(m, r, jnp.float32) for m in (4096, 16384, 65536) for r in (128, 512, 1024)]
  rcqr_cases += [(m, 512, jnp.bfloat16) for m in (4096, 16384, 65536)]
  seed = jnp.uint32(1)
  for m, r, dtype in rcqr_cases:
    if time.monotonic() > deadline:
      break
    P = _conditioned(m, r, dtype, seed=0)
    cases = {
        "pallas": (jax.jit(functools.partial(qr.rcqr, backend="pallas")), (P, seed)),
        "xla": (jax.jit(functools.partial(qr.rcqr, backend="xla")), (P, seed)),
        "householder": (jax.jit(lambda P: jnp.linalg.qr(P.astype(jnp.float32))[0]), (P,)),
    }
    times = interleaved_times(cases, rounds=3, repeats=10)
    rows.append({"kernel": "rcqr", "shape": [m, r], "dtype": jnp.dtype(dtype).name,
                 **{k: v * 1e3 for k, v in times.items()}})
    _print_timing(rows[-1])
  ns_cases = [(1, 1024, 4096), (1, 2048, 8192), (1, 4096, 4096), (12, 768, 3072), (12, 1024, 4096)]
  for dtype in (jnp.bfloat16, jnp.float32):
    for b, s, l in ns_cases:
      if time.monotonic() > deadline:
        break
      X = jnp.asarray(np.random.default_rng(0).standard_normal((b, s, l)) / np.sqrt(l), dtype)
      precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
      cases = {name: (jax.jit(lambda x, f=f: f(x, -2.8, 0.5, precision)), (X,)) for name, f in
               (("pallas", newton_schulz.symmetric_products), ("xla", newton_schulz_xla.xla_symmetric_products))}
      times = interleaved_times(cases, rounds=3, repeats=10)
      rows.append({"kernel": "ns symmetric products", "shape": [b, s, l], "dtype": jnp.dtype(dtype).name,
                   **{k: v * 1e3 for k, v in times.items()}})
      _print_timing(rows[-1])
  for b, m, n in ((1, 4096, 4096), (1, 8192, 8192), (12, 768, 3072), (12, 3072, 768)):
    if time.monotonic() > deadline:
      break
    G = jnp.asarray(np.random.default_rng(1).standard_normal((b, m, n)), jnp.float32)
    cases = {backend: (jax.jit(functools.partial(polar.polar_factor, backend=backend)), (G,))
             for backend in ("pallas", "xla")}
    times = interleaved_times(cases, rounds=3, repeats=5)
    rows.append({"kernel": "polar factor (bf16)", "shape": [b, m, n], "dtype": "float32",
                 **{k: v * 1e3 for k, v in times.items()}})
    _print_timing(rows[-1])
  return {"rows": rows, "unit": "ms", "complete": time.monotonic() <= deadline}


def _print_timing(row: dict) -> None:
  times = " ".join(f"{k} {row[k]:.3f}" for k in ("pallas", "xla", "householder") if k in row)
  print(f"  {row['kernel']:22s} {str(row['shape']):18s} {row['dtype']:8s} ms: {times}"
        f" | xla/pallas {row['xla'] / row['pallas']:.2f}x", flush=True)


# --- optimizers --------------------------------------------------------------------


def optimizers() -> dict[str, Callable[[], optax.GradientTransformation]]:
  """Each optimizer of the figure, applied to every leaf (one square matrix)."""
  matrix = {"labels": lambda params: jax.tree.map(lambda _: "dion", params)}
  muon_dims = optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
  return {
      "dion r=1": lambda: dion_jax.dion(0.01, rank_fraction=1.0, **matrix),
      "dion r=1/4": lambda: dion_jax.dion(0.01, rank_fraction=0.25, **matrix),
      "dion r=1/16": lambda: dion_jax.dion(0.01, rank_fraction=1 / 16, **matrix),
      "dion2 1/4": lambda: dion_jax.dion2(0.01, fraction=0.25, **matrix),
      "normuon": lambda: dion_jax.normuon(0.01, **matrix),
      "muon": lambda: dion_jax.muon(0.01, **matrix),
      "optax muon": lambda: optax.contrib.muon(0.01, muon_weight_dimension_numbers=lambda p: jax.tree.map(
          lambda _: muon_dims, p)),
      "optax adamw": lambda: optax.adamw(1e-3),
  }


def _out_of_memory(error: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def stage_optimizers(args) -> dict:
  rows, deadline = [], time.monotonic() + args.stage_seconds
  gone = set()  # optimizers that ran out of memory at a smaller size
  n = 2048
  while n <= args.max_size and time.monotonic() < deadline:
    params = {"w": jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / np.sqrt(n)}
    row = {"n": n}
    for name, make in optimizers().items():
      if name in gone or time.monotonic() > deadline:
        continue
      try:
        step, step_args, _ = jitted_step(make(), params)
        row[name] = time_fn(step, step_args, repeats=9, warmup=2) * 1e3
        del step_args
      except Exception as e:  # noqa: BLE001: a size that does not fit ends that optimizer's curve
        if not _out_of_memory(e):
          raise
        gone.add(name)
        row[name] = "out of memory"
    rows.append(row)
    print(f"  n={n:6d} " + " | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items() if k != "n") + " (ms)", flush=True)
    n *= 2
  return {"rows": rows, "unit": "ms per step", "complete": n > args.max_size}


# --- train -------------------------------------------------------------------------


def train_run(preset: str, optimizer: str, steps: int, batch: int, attention: str,
              profile_dir: str | None = None) -> dict:
  """The trainer's numbers of the last log interval (after the compiling first one)."""
  from train import config as config_lib
  from train import log, loop

  with tempfile.TemporaryDirectory() as run_dir:
    cfg = config_lib.Config(
        preset=preset, optimizer=optimizer, dtype="bfloat16", attention=attention, steps=steps,
        log_interval=steps // 2, global_batch_size=batch, eval_tokens=0, save_every=0,
        run_dir=run_dir, mesh="fs=1")
    cfg.check()
    run = loop.setup(cfg)
    if profile_dir:
      with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
        code = loop.train(run)
    else:
      code = loop.train(run)
    if code:
      raise RuntimeError(f"the trainer exited with {code}")
    intervals, _ = log.read_metrics(run_dir)
    record = intervals[max(intervals)]
  stats = jax.devices()[0].memory_stats() or {}
  return {"preset": preset, "optimizer": optimizer, "attention": attention, "global_batch": batch,
          "seq_len": run.model_cfg.seq_len, "params_M": run.model_cfg.num_params() / 1e6,
          "ms_per_step": record["ms_per_step"], "tokens_per_s": record["tokens_per_s"],
          "tflops": record["tflops_per_device"], "mfu": record.get("mfu"),
          # The allocator's peak since the process started: runs go from small to large.
          "process_peak_memory_GiB": stats.get("peak_bytes_in_use", 0) / 2**30}


def stage_train(args) -> dict:
  rows, deadline = [], time.monotonic() + args.stage_seconds
  for preset, batch in (("small", 32), ("350m", 16)):
    for optimizer in ("adamw", "dion"):
      if time.monotonic() > deadline:
        break
      row = train_run(preset, optimizer, args.train_steps, batch, "cudnn")
      rows.append(row)
      print(f"  {preset} {optimizer}: {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s,"
            f" {row['tflops']:.1f} TFLOP/s, MFU {100 * (row['mfu'] or 0):.1f}%,"
            f" process peak {row['process_peak_memory_GiB']:.1f} GiB", flush=True)
  return {"rows": rows, "complete": len(rows) == 4}


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


def stage_profile(args) -> dict:
  with tempfile.TemporaryDirectory() as trace_dir:
    train_run("small", "dion", 6, 32, "cudnn", profile_dir=trace_dir)
    traces = [os.path.join(d, f) for d, _, files in os.walk(trace_dir) for f in files
              if f.endswith("perfetto_trace.json.gz")]
    rows = summarize_trace(traces[0])
  for row in rows[:10]:
    print(f"  {row['ms']:9.1f} ms {row['count']:6d}x {100 * row['share']:5.1f}%  {row['kernel'][:80]}", flush=True)
  return {"rows": rows, "steps": 6, "what": "small, Dion rank 1, batch 32 x 1024, 6 steps with compilation"}


# --- output ------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
  steps = results.get("optimizers", {}).get("rows", [])
  for name in optimizers():
    points = [(r["n"], r[name]) for r in steps if isinstance(r.get(name), float)]
    if points:
      left.plot(*zip(*points), marker="o", label=name)
  left.set(xscale="log", yscale="log", xlabel="matrix size n (n x n)", ylabel="ms per optimizer step",
           title="optimizer step time vs matrix size")
  left.legend(fontsize=8)
  kernels = [r for r in results.get("kernels", {}).get("rows", []) if "pallas" in r]
  labels = [f"{r['kernel'].split()[0]} {'x'.join(map(str, r['shape']))} {r['dtype'][:4]}" for r in kernels]
  right.barh(range(len(kernels)), [r["xla"] / r["pallas"] for r in kernels])
  right.axvline(1.0, color="k", lw=0.8)
  right.set_yticks(range(len(kernels)), labels, fontsize=7)
  right.set(xlabel="XLA time / Pallas time (>1: Pallas faster)", title="Pallas kernels against XLA")
  fig.suptitle(results["device"])
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def device_slug(kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
  parser.add_argument("--out", help="output folder (default benchmarks/results/gpu/<device>)")
  parser.add_argument("--stage-seconds", type=float, default=80.0,
                      help="time after which a stage starts no new case (default 80)")
  parser.add_argument("--max-size", type=int, default=16384, help="largest n of the optimizers stage")
  parser.add_argument("--train-steps", type=int, default=30, help="trainer steps per run (default 30)")
  args = parser.parse_args(argv)
  stages = args.stages.split(",")
  unknown = set(stages) - set(STAGES)
  if unknown:
    parser.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
  if jax.default_backend() != "gpu":
    print(f"error: no GPU here (JAX's default backend is {jax.default_backend()}); run this on an NVIDIA GPU",
          file=sys.stderr)
    return EXIT_NO_GPU
  device = jax.devices()[0].device_kind
  out = args.out or os.path.join("benchmarks", "results", "gpu", device_slug(device))
  os.makedirs(out, exist_ok=True)
  results = {"device": device, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
             "command": "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:])}
  functions = {"check": stage_check, "kernels": stage_kernels, "optimizers": stage_optimizers,
               "train": stage_train, "profile": stage_profile}
  for name in stages:
    print(f"== {name}", flush=True)
    t0 = time.monotonic()
    try:
      results[name] = functions[name](args)
    except Exception as e:  # noqa: BLE001: one stage's failure is reported, the others still run
      traceback.print_exc()
      results[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    results[name]["seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out, "gpu.json"), "w") as f:
      json.dump(results, f, indent=1)
  plot(results, os.path.join(out, "gpu.png"))
  print(f"wrote {out}/gpu.json and gpu.png", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
