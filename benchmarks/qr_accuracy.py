"""How orthonormal each orthonormalization of Dion's P is, pass by pass, against float64 NumPy.

    python -m benchmarks.qr_accuracy [--out benchmarks/results/qr_accuracy.md]

On the hard cases of ``tests/test_linalg_qr.py`` (singular values logspaced from 1 to
1/cond, a duplicated or a zero column, rank r/2) at 300 x 40, 64 x 64 (square) and
768 x 384 (``small``'s P at rank 1/2: three diagonal blocks), for every pass of shifted
Cholesky QR:

- ``lapack``: each pass's factor from ``jnp.linalg.cholesky`` and a triangular inverse
  (LAPACK here; cuSOLVER's potrf and cuBLAS's trsm on a GPU): the arithmetic of
  ``"shifted_cqr"`` before issue 44;
- ``blocked``: ``dion_jax.linalg.cholesky.inverse_cholesky``, its diagonal blocks by
  XLA's loop (the CPU path) and by the Pallas kernel in the interpreter (the GPU path's
  arithmetic, up to the GPU's own rounding of division);

- ``blocked, TF32x3 passes``: ``precision="tensorfloat32x3"``, the passes' Grams and ``P W``
  as XLA's ``TF32_TF32_F32_X3`` dot algorithm computes them on a GPU (three TF32 products on
  the tensor cores), emulated (``dion_jax.linalg.tf32``): what it costs in accuracy;

and the final P of ``"polar"`` (Polar Express in bfloat16 on the r x r Gram) and of
float32 Householder QR. Columns: ``‖QᵀQ − I‖₂`` and the span residual
``‖(I − QQᵀ)P‖_F / ‖P‖_F``, both in float64.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dion_jax.linalg import qr

SHAPES = ((300, 40), (64, 64), (768, 384))
KINDS = ("cond1", "cond1e3", "cond1e6", "cond1e9", "cond1e12", "duplicate", "zero_column", "half_rank")


def case(kind: str, m: int, r: int) -> np.ndarray:
  rng = np.random.default_rng(0)
  if kind == "half_rank":
    return rng.normal(size=(m, r // 2)) @ rng.normal(size=(r // 2, r))
  cond = 10.0 if kind in ("duplicate", "zero_column") else float(kind[4:])
  U = np.linalg.qr(rng.normal(size=(m, r)))[0]
  V = np.linalg.qr(rng.normal(size=(r, r)))[0]
  P = (U * np.logspace(0, -np.log10(cond), r)) @ V.T
  if kind == "duplicate":
    P[:, 1] = P[:, 0]
  if kind == "zero_column":
    P[:, 3] = 0.0
  return P


def errors(Q, P) -> tuple[float, float]:
  Q, P = np.asarray(Q, np.float64), np.asarray(P, np.float64)
  orth = np.linalg.norm(Q.T @ Q - np.eye(Q.shape[1]), 2)
  return orth, np.linalg.norm(P - Q @ (Q.T @ P)) / np.linalg.norm(P)


_F32 = lambda spec, a, b: jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)  # noqa: E731


def _factor_lapack(G):
  R = jnp.swapaxes(jnp.linalg.cholesky(G), 1, 2)
  return lax.linalg.triangular_solve(R, jnp.broadcast_to(jnp.eye(G.shape[-1]), R.shape), left_side=True, lower=False)


def passes(P_bxmxr, factor):
  """The four passes of shifted Cholesky QR with the factor W = R⁻¹ from ``factor``: the
  library's passes with their factorization swapped."""
  r = P_bxmxr.shape[-1]
  rms = jnp.sqrt(jnp.sum(P_bxmxr**2, axis=(1, 2), keepdims=True) / r)
  P_bxmxr = P_bxmxr + qr.FILL * rms * qr.fill_columns(P_bxmxr.shape[1], r)
  out = []
  for shifted in (True, True, False, False):
    G = _F32("bmr,bms->brs", P_bxmxr, P_bxmxr)
    if shifted:
      G = G + float(jnp.finfo(jnp.float32).eps) * jnp.trace(G, axis1=1, axis2=2)[:, None, None] * jnp.eye(r)
    P_bxmxr = _F32("bmr,brs->bms", P_bxmxr, factor(G))
    out.append(P_bxmxr)
  return out


METHODS = {
    "lapack": jax.jit(lambda P: passes(P, _factor_lapack)),
    "blocked (XLA)": jax.jit(lambda P: qr.shifted_cholesky_qr_passes(P, backend="xla")),
    "blocked (Pallas)": jax.jit(lambda P: qr.shifted_cholesky_qr_passes(P, backend="pallas")),
    "blocked, TF32x3 passes": jax.jit(lambda P: qr.shifted_cholesky_qr_passes(P, backend="xla",
                                                                              precision="tensorfloat32x3")),
    "polar (bf16)": jax.jit(lambda P: [qr.orthonormalize_batch(P, method="polar", backend="xla")]),
    "householder (f32)": jax.jit(lambda P: [qr.orthonormalize_batch(P, method="qr", backend="xla")]),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.qr_accuracy", description=__doc__.split("\n\n")[0])
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  lines = ["| shape | P | method | ‖QᵀQ − I‖₂ after passes 1, 2, 3, 4 | span residual (last) |", "|---|---|---|---|---|"]
  worst = {}
  for m, r in SHAPES:
    for kind in KINDS:
      P = case(kind, m, r)
      P32 = jnp.asarray(P, jnp.float32)[None]
      for name, f in METHODS.items():
        outs = [np.asarray(Q[0]) for Q in f(P32)]
        errs = [errors(Q, P) for Q in outs]
        orth = ", ".join(f"{e[0]:.1e}" for e in errs)
        lines.append(f"| {m} x {r} | {kind} | {name} | {orth} | {errs[-1][1]:.1e} |")
        w = worst.setdefault(name, [0.0, 0.0])
        w[0], w[1] = max(w[0], errs[-1][0]), max(w[1], errs[-1][1])
      print(lines[-len(METHODS):], flush=True)
  lines += ["", "| method | worst ‖QᵀQ − I‖₂ | worst span residual |", "|---|---|---|"]
  lines += [f"| {n} | {w[0]:.1e} | {w[1]:.1e} |" for n, w in worst.items()]
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write("`python -m benchmarks.qr_accuracy`\n\n" + text + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
