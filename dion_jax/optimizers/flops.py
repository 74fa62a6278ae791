"""Flops of one optimizer step on a set of matrices: the formulas the GPU evidence turns into rates.

:func:`step_flops` counts, for ``"dion"``, ``"muon"``, ``"dion2"`` and ``"adamw"`` on
matrices of shapes (m, n), with 2 flops per multiply-add:

- ``matmul``: every matrix product as the implementation executes it (dense operands,
  padding included), per matrix with s = min(m, n), l = max(m, n):
  Dion, rank r:  4·m·n·r per power iteration (B Q, Bᵀ P) + 4·m·n·r (P Rᵀ, P Qᵀ), plus
  its orthonormalization of P (l x r):
    ``shifted_cqr``  4 passes x (2lr² Gram + 2lr² P W + the blocked inverse Cholesky's
                     matmuls, ``dion_jax.linalg.cholesky.flops``);
    ``cqr``          those and one more pass, both computed;
    ``rcqr``         2klr (sketch, k = 128·ceil(oversample·r/128)) + 6lr² (two solves
                     and a Gram) where l > r, none where P is square;
    ``qr``           none (Householder);
    ``polar``        Polar Express in bf16 on P (``dion_jax.linalg.polar.flops``, Gram
                     steps where l ≥ 2r: 12r²l + 22r³; standard: 20r²l + 10r³).
  Muon: Polar Express on the matrix, 20s²l + 10s³. Dion2 (fraction f): Polar Express on
  the k = ceil(f·s) selected slices of length l. AdamW: none.
- ``factorization``: the small factorizations' useful flops: the inverse Cholesky's
  diagonal blocks (b³/3 + b³/3 each), Cholesky r³/3 and triangular inverse r³/3, and
  Householder QR 2ab² − 2b³/3 for an a x b matrix (and as much again to form Q).
- ``elementwise``: AdamW's 15 flops per entry (XLA's cost analysis of optax's update and
  apply). The matrix optimizers' elementwise work (momentum, error feedback, scaling, a
  few flops per entry, under 1% of their matmuls at these ranks) is not counted.

``tests/test_optimizers_flops.py`` holds ``matmul`` to the products counted in each
optimizer's traced step, and ``elementwise`` to XLA's cost analysis.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from dion_jax.kernels import sketch
from dion_jax.linalg import cholesky, polar
from dion_jax.optimizers.frame import dion_rank

OPTIMIZERS = ("dion", "muon", "dion2", "adamw")
ADAMW_FLOPS_PER_ENTRY = 15


def _householder_r(a: int, b: int) -> int:
  """Householder QR's R of an a x b matrix (a ≥ b); forming Q costs as much again."""
  return 2 * a * b * b - 2 * b**3 // 3


def _dion(m: int, n: int, r: int, qr_method: str, oversample: float, power_iters: int) -> tuple[int, int]:
  """``(matmul, factorization)`` of one Dion step on an m x n matrix at rank r; P is
  max(m, n) x r (rows: the longer side, the frame without tensor parallelism)."""
  rows = max(m, n)
  products = 4 * m * n * r * power_iters + 4 * m * n * r
  chol_matmul, chol_blocks = cholesky.flops(r)
  if qr_method in ("shifted_cqr", "cqr"):
    passes = 4 if qr_method == "shifted_cqr" else 5
    return products + passes * (4 * rows * r * r + chol_matmul), passes * chol_blocks
  if qr_method == "polar":
    return products + polar.flops(r, rows, gram=True), 0
  if qr_method == "rcqr" and rows > r:
    k = sketch.sketch_size(r, oversample)
    # R₁ of the sketch, then R₂'s Cholesky and the two triangular inverses (r³/3 each).
    return products + 2 * k * rows * r + 6 * rows * r * r, _householder_r(k, r) + r**3
  return products, 2 * _householder_r(rows, r)


def step_flops(
    optimizer: str,
    shapes: Sequence[tuple[int, int]],
    *,
    rank_fraction: float = 1.0,
    qr_method: str = "shifted_cqr",
    oversample: float = 1.25,
    power_iters: int = 1,
    fraction: float = 0.25,
) -> dict[str, int]:
  """``{"matmul", "factorization", "elementwise", "total"}`` flops of one step of
  ``optimizer`` on matrices of ``shapes`` (module docstring).

  Args:
    optimizer: ``"dion"``, ``"muon"``, ``"dion2"`` or ``"adamw"``.
    shapes: one (m, n) per matrix (stacked parameters: one entry per matrix).
    rank_fraction, qr_method, oversample, power_iters: Dion's (``qr_method`` resolved:
      not ``"auto"``).
    fraction: Dion2's selected fraction of the shorter side.
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer={optimizer!r} is not counted; use one of {OPTIMIZERS}")
  out = {"matmul": 0, "factorization": 0, "elementwise": 0}
  for m, n in shapes:
    s, l = min(m, n), max(m, n)
    if optimizer == "dion":
      matmul, factorization = _dion(m, n, dion_rank(rank_fraction, 1, m, n), qr_method, oversample, power_iters)
      out["matmul"] += matmul
      out["factorization"] += factorization
    elif optimizer == "muon":
      out["matmul"] += polar.flops(s, l)
    elif optimizer == "dion2":
      k = max(1, math.ceil(fraction * s))
      out["matmul"] += polar.flops(min(k, l), max(k, l))
    else:
      out["elementwise"] += ADAMW_FLOPS_PER_ENTRY * m * n
  out["total"] = sum(out.values())
  return out
