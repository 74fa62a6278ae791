"""The kernel stages of ``python -m train.gpu``: every Pallas kernel's numerics
against its XLA composition and float64 NumPy (``check``), and their times against XLA
(``kernels``). Each stage takes the command's arguments and returns its JSON record."""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dion_jax.kernels import newton_schulz, newton_schulz_xla, rcqr_xla, sketch
from dion_jax.kernels import rcqr as pallas_rcqr
from dion_jax.linalg import polar, qr
from train.gpu.timing import interleaved_times

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
  coefficients, safety = polar.METHODS[method].coefficients, polar.METHODS[method].safety
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
