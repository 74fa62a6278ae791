"""GPU benchmark of randomized Cholesky QR: Pallas kernels vs XLA passes vs Householder QR.

    python -m benchmarks.gpu_rcqr            # on a GPU: time, GB/s, fraction of copy bandwidth
    python -m benchmarks.gpu_rcqr --count    # anywhere: counted bytes and flops per kernel

For m in {4096, 16384, 65536}, r in {128, 512, 1024}, float32 and bfloat16 inputs, the
timed table reports each method's median time, its achieved bandwidth (counted
bytes of ``pallas_rcqr.counted_costs`` over time; for ``jnp.linalg.qr`` one read of
P and one write of Q) and that bandwidth's fraction of the device's measured copy
bandwidth, its counted TFLOP/s, and the Pallas speedup over XLA's RCQR. Without a
GPU the timed mode says so and exits 0.
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks import harness  # noqa: F401  limits OpenBLAS's threads before any LAPACK call
from dion_jax.kernels import rcqr as pallas_rcqr
from dion_jax.kernels import sketch
from dion_jax.linalg import qr
from train.gpu import timing

MS = (4096, 16384, 65536)
RS = (128, 512, 1024)
DTYPES = (jnp.float32, jnp.bfloat16)
PASSES = ("sketch", "solve+gram", "solve")
REPEATS = 20  # timed calls per case, after one warm-up


def copy_bandwidth() -> float:
  """Bytes per second of a 1 GiB read + write on the default device."""
  x = jnp.ones((1 << 28,), jnp.float32)
  return 2 * x.nbytes / timing.time_fn(jax.jit(lambda v: v + 1.0), (x,), REPEATS)


def print_counts() -> None:
  print("Counted per matrix (MB moved, GFLOP); Pallas | XLA composition. "
        "Pallas also does rng_ops (integer) to generate S in registers.")
  header = f"{'dtype':>8} {'m':>6} {'r':>5} {'k':>5} " + " ".join(
      f"{p + ' MB':>22} {p + ' GF':>20}" for p in PASSES) + f" {'total MB':>17} {'total GF':>15} {'rng Gops':>9}"
  print(header)
  for dtype in DTYPES:
    for m in MS:
      for r in RS:
        k = sketch.sketch_size(r, 1.25)
        c = pallas_rcqr.counted_costs(m, r, k, jnp.dtype(dtype).itemsize)
        cells = []
        for p in PASSES:
          (pb, pf), (xb, xf) = c["pallas"][p], c["xla"][p]
          cells.append(f"{pb / 1e6:10.1f} |{xb / 1e6:10.1f} {pf / 1e9:9.2f} |{xf / 1e9:9.2f}")
        tot = {s: [sum(c[s][p][i] for p in PASSES) for i in (0, 1)] for s in ("pallas", "xla")}
        print(f"{jnp.dtype(dtype).name:>8} {m:>6} {r:>5} {k:>5} " + " ".join(cells)
              + f" {tot['pallas'][0] / 1e6:7.1f} |{tot['xla'][0] / 1e6:7.1f}"
              + f" {tot['pallas'][1] / 1e9:6.2f} |{tot['xla'][1] / 1e9:6.2f}"
              + f" {c['pallas']['rng_ops'][1] / 1e9:9.2f}")


def run_timings() -> None:
  bandwidth = copy_bandwidth()
  print(f"device: {jax.devices()[0].device_kind}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
  methods = {
      "pallas": jax.jit(functools.partial(qr.rcqr, backend="pallas")),
      "xla": jax.jit(functools.partial(qr.rcqr, backend="xla")),
      "householder": jax.jit(lambda P, seed: jnp.linalg.qr(P.astype(jnp.float32))[0]),
  }
  print(f"{'dtype':>8} {'m':>6} {'r':>5} {'method':>12} {'ms':>9} {'GB/s':>7} {'of copy':>8} {'TFLOP/s':>8} {'vs xla':>7}")
  for dtype in DTYPES:
    for m in MS:
      for r in RS:
        k = sketch.sketch_size(r, 1.25)
        itemsize = jnp.dtype(dtype).itemsize
        costs = pallas_rcqr.counted_costs(m, r, k, itemsize)
        counted = {
            s: tuple(sum(costs[s][p][i] for p in PASSES) for i in (0, 1)) for s in ("pallas", "xla")}
        counted["householder"] = (itemsize * m * r + 4 * m * r, 4 * m * r * r - 4 * r**3 // 3)
        P = jax.random.normal(jax.random.key(0), (m, r), jnp.float32).astype(dtype)
        seed = jnp.uint32(1)
        times = {name: timing.time_fn(f, (P, seed), REPEATS) for name, f in methods.items()}
        for name, t in times.items():
          nbytes, flops = counted[name]
          print(f"{jnp.dtype(dtype).name:>8} {m:>6} {r:>5} {name:>12} {t * 1e3:9.3f} {nbytes / t / 1e9:7.0f}"
                f" {nbytes / t / bandwidth:8.2f} {flops / t / 1e12:8.1f} {times['xla'] / t:7.2f}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_rcqr",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--count", action="store_true", help="print counted bytes and flops per kernel and exit")
  args = parser.parse_args(argv)
  if args.count:
    print_counts()
    return 0
  if jax.default_backend() != "gpu":
    print(f"No GPU (default backend: {jax.default_backend()}): nothing to time. "
          "`--count` prints the counted bytes and flops per kernel.")
    return 0
  run_timings()
  return 0


if __name__ == "__main__":
  sys.exit(main())
