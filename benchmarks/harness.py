"""What every benchmark shares: process set-up, meshes, timing, GPT matrices, a jitted step.

Benchmarks run as modules from the repository root, ``python -m benchmarks.NAME``.
Importing this module limits OpenBLAS to one thread, as ``python -m train.gpt`` does
(see ``train/gpt.py`` for why), unless the caller set OPENBLAS_NUM_THREADS.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy  # noqa: F401  numpy's own OpenBLAS loads first, keeping its threads

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import dion_jax  # noqa: E402


def setup_process(cpu_devices: int | None = None, platform: str | None = None) -> None:
  """Chooses the platform and the number of CPU devices; call it before JAX's backend starts.

  ``platform`` (e.g. ``"cpu"``) applies unless JAX_PLATFORMS is set. ``cpu_devices``
  host devices let a CPU hold a mesh; GPUs ignore it.
  """
  if platform is not None and "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", platform)
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)


def mesh(spec: str) -> jax.sharding.Mesh:
  """The mesh of ``spec`` (e.g. ``"pp=2"``, ``""`` for one device) on the first devices."""
  sizes = dion_jax.parse_mesh_spec(spec)
  n = math.prod(sizes.values())
  devices = jax.devices()
  if n > len(devices):
    raise ValueError(f"mesh {spec!r} needs {n} devices but {len(devices)} {devices[0].platform}"
                     f" devices exist; on CPU, call setup_process(cpu_devices={n}) first")
  return dion_jax.make_mesh(sizes, devices[:n])


def _call(fn, args) -> None:
  jax.block_until_ready(fn(*args))


def time_fn(fn, args, repeats: int, warmup: int = 1) -> float:
  """Median wall time of ``fn(*args)`` in seconds over ``repeats`` calls after ``warmup`` calls."""
  for _ in range(warmup):
    _call(fn, args)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _call(fn, args)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def interleaved_times(cases: dict, rounds: int, repeats: int) -> dict[str, float]:
  """Median over ``rounds`` of each case's median time, the cases taking turns.

  The machines here are shared: their speed drifts by ±10% over seconds. Timing
  every case in every round, the plain matmul included, makes the ratios between
  cases (what the table reports) robust to that drift.
  """
  for fn, args in cases.values():
    for _ in range(2):  # Compile and warm up.
      _call(fn, args)
  per_round = {name: [] for name in cases}
  for _ in range(rounds):
    for name, (fn, args) in cases.items():
      per_round[name].append(time_fn(fn, args, repeats, warmup=0))
  return {name: statistics.median(ts) for name, ts in per_round.items()}


def throughput_time(fn, args, steps: int) -> float:
  """Mean seconds per call over ``steps`` chained calls ``args = fn(*args)``, one wait at the end.

  This is how a trainer runs its steps: the host queues the next step while the
  device works, so host overhead that overlaps with device time costs nothing. ``fn``
  returns its next arguments (a step that donates its state hands on the new one).
  One call first compiles and warms up.
  """
  args = fn(*args)
  jax.block_until_ready(args)
  start = time.perf_counter()
  for _ in range(steps):
    args = fn(*args)
  jax.block_until_ready(args)
  return (time.perf_counter() - start) / steps


def gpt_matrices(layers: int, d: int, fused_qkv: bool = True) -> dict[str, jax.Array]:
  """A GPT's matrices as Flax kernels stacked over layers, ``(layers, fan_in, fan_out)``.

  Per layer the attention's query, key and value (one fused ``qkv`` (d, 3d) kernel,
  or ``q``, ``k``, ``v`` (d, d) each), ``out`` (d, d), ``fc1`` (d, 4d) and ``fc2``
  (4d, d). Fused is what the published step-time figures measured.
  """
  attention = {"qkv": (d, 3 * d)} if fused_qkv else {"q": (d, d), "k": (d, d), "v": (d, d)}
  shapes = {**attention, "out": (d, d), "fc1": (d, 4 * d), "fc2": (4 * d, d)}
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return {
      name: jax.random.normal(k, (layers,) + shape, jnp.float32) * shape[0] ** -0.5
      for k, (name, shape) in zip(keys, shapes.items())
  }


def matrix_benchmark_parser(description: str, repeats: int = 5) -> argparse.ArgumentParser:
  """The flags of the benchmarks that time optimizer steps on :func:`gpt_matrices`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--d-model", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=repeats, help="timed calls per case and round")
  parser.add_argument("--rounds", type=int, default=5, help="rounds in which every case is timed in turn")
  return parser


def jitted_step(tx, params):
  """A jitted update + apply, its arguments, and the optimizer state's bytes."""
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape, p.dtype) * 1e-2, params)
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  return step, (params, state, grads), state_bytes
