"""What every benchmark shares: process set-up, meshes, GPT matrices (timing: ``train/gpu/timing.py``).

Benchmarks run as modules from the repository root, ``python -m benchmarks.NAME``.
Importing this module limits OpenBLAS to one thread, as ``python -m train.gpt`` does
(see ``train/run/start.py`` for why), unless the caller set OPENBLAS_NUM_THREADS.
"""
from __future__ import annotations

import argparse
import math
import os

import numpy  # noqa: F401  numpy's own OpenBLAS loads first, keeping its threads

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

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


def add_out(parser: argparse.ArgumentParser, committed: str, what: str) -> None:
  """``--out``, where a benchmark writes ``what``: by default ``runs/benchmarks/NAME`` in
  the working directory, never over the repository's committed results unless they are
  asked for (``--out committed``)."""
  default = os.path.join("runs", "benchmarks", os.path.basename(committed))
  parser.add_argument("--out", default=default, metavar="PATH",
                      help=f"where {what} go (default {default}; the repository's committed ones are"
                           f" {committed}: pass --out {committed} to replace them)")


def matrix_benchmark_parser(name: str, description: str, repeats: int = 5) -> argparse.ArgumentParser:
  """The flags of the benchmarks that time optimizer steps on :func:`gpt_matrices`
  (``python -m benchmarks.NAME``)."""
  parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--d-model", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=repeats, help="timed calls per case and round")
  parser.add_argument("--rounds", type=int, default=5, help="rounds in which every case is timed in turn")
  return parser

