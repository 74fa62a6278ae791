"""Pallas GPU kernels for the heavy passes of randomized Cholesky QR, and their costs.

``dion_jax.linalg.qr.rcqr`` makes three passes over the tall P (m x r):

    SP = S P                      sketch_product   (S: k x m Gaussian, k = 1.25 r rounded to 128)
    P1 = P R1⁻¹,  G = P1ᵀ P1      solve_and_gram   (R1 = qr_r(SP))
    P2 = P1 R2⁻¹                  solve            (R2 = chol(G))

This module implements them as Pallas kernels with the same signatures and
semantics as the ``xla_*`` passes there (R upper triangular r x r float32; P
float32 or bfloat16; outputs float32, float32 accumulation).

Kernels (B matrices of m x r, k sketch rows, s = bytes per element of P):

- ``sketch_product``: program (matrix, k-tile, r-tile, row chunk) streams its rows
  of P and generates its tile of S in registers with
  ``sketch.sketch_entries`` (the same counter hash as ``sketch.sketch_block``,
  so the result equals ``sketch_block(seed, row_start, m, k) @ P`` to float32
  rounding, on every rp replica and for any tp split). S is never in memory.
  Row chunks write partial (k x r) sums that XLA adds: deterministic, unlike atomics.
- ``solve_and_gram``: R⁻¹ (r x r) is formed by XLA (r³/3 flops, negligible), then
  P1 = P R⁻¹ is a matmul that skips the zero blocks of the triangular R⁻¹
  (m r² flops, as a triangular solve, but at matmul speed). For r ≤ 128 a single
  fused kernel also accumulates the Gram P1ᵀ P1 from registers (P read once,
  per-chunk partial Grams summed by XLA). For r > 128 the r x r Gram tiles cannot
  live in registers next to the P1 tile, so a second kernel computes only the
  upper-triangular Gram tiles (m r² flops instead of XLA's 2 m r²) from P1; it
  re-reads P1 (4 m r bytes), which costs < 10% of that kernel's time at r ≥ 256
  where it does 64+ flops per byte.
- ``solve``: the same triangular matmul as above.

Counted per matrix (``counted_costs`` computes them; ``python -m benchmarks.gpu_rcqr
--count`` prints the table), with C partial-sum chunks:

    pass         Pallas bytes                        XLA composition bytes                Pallas flops     XLA flops
    sketch       s m r + 4 C k r                     8 k m (S written, read) + s m r      2 k m r          2 k m r
    solve+gram   s m r + 4 m r + 4 C r'² (r ≤ 128)   s m r + 4 m r (trsm) + 4 m r (Gram)  4 m r'²          3 m r²
                 s m r + 8 m r + 4 C r'² (r > 128)                                        2 m r'(r' + 64)
    solve        8 m r                               8 m r                                m r'(r' + 64)    m r²

r' is r padded to the tiles (a power of two ≤ 128, else a multiple of 64); the
Pallas flops are those executed, padding included, and the sketch also spends about
20 integer ops per entry of S (one hash, a byte sum; no transcendentals) per
128-column tile of P.
For m = 16384, r = 512, k = 640, float32: Pallas 218 MB and 25.2 GFLOP, XLA
288 MB and 27.9 GFLOP (bfloat16 P: 184 MB against 254 MB). The savings are S,
never written (4 k m bytes, written and read again by XLA), and the Gram's lower
triangle; the triangular matmul replaces a cuBLAS trsm, which runs well below
matmul speed on tall matrices. Partial sums are capped at 1/4 of P's float32
bytes. At r ≥ 128 every pass does ≥ 32 flops per byte, so the kernels are
compute bound on an H100: they use tensor cores through Triton's TF32x3 (three
TF32 products, float32 accuracy) rather than float32 FMA.

The kernels live in ``rcqr_sketch`` and ``rcqr_solve``, on the shared Pallas set-up of
``dion_jax.kernels.pallas_common``; the XLA composition of the same passes is in
``dion_jax.kernels.rcqr_xla``.
"""

from dion_jax.kernels.pallas_common import (
  BK_SKETCH,
  BM,
  BN_GRAM,
  BN_SKETCH,
  BN_SOLVE,
  FUSED_MAX_R,
  padded_rank,
  partial_cap,
  round_up,
  row_chunks,
)  # fmt: skip
from dion_jax.kernels.rcqr_sketch import sketch_product
from dion_jax.kernels.rcqr_solve import solve, solve_and_gram

__all__ = ["counted_costs", "sketch_product", "solve", "solve_and_gram"]


def counted_costs(m: int, r: int, k: int, itemsize: int) -> dict[str, dict[str, tuple[int, int]]]:
  """Bytes moved and flops per pass, ``{"pallas"|"xla": {pass: (bytes, flops)}}``, one matrix.

  Bytes count reads and writes of HBM arrays by each kernel, without cache reuse of
  tiles (re-reads of P by several r-tiles are assumed to hit L2). Flops count
  multiply-adds as two; the sketch's ~20 integer ops per generated
  entry are listed separately as ``rng_ops`` under ``"pallas"``.
  """
  f32 = 4
  num_rt = -(-r // BN_SKETCH)
  chunks_sketch, _ = row_chunks(-(-m // BM), -(-k // BK_SKETCH) * num_rt, partial_cap(m, k))
  r_pad = padded_rank(r)
  r_solve = round_up(max(r, BN_SOLVE), BN_SOLVE)
  p_in, p32 = itemsize * m * r, f32 * m * r
  # Flops as executed: padded tiles, and only the tiles on or above R⁻¹'s diagonal.
  tri_flops = m * r_solve * (r_solve + BN_SOLVE)
  pallas = {"sketch": (p_in + f32 * chunks_sketch * k * r, 2 * k * m * num_rt * BN_SKETCH)}
  if r_pad <= FUSED_MAX_R:
    chunks_gram, _ = row_chunks(-(-m // BM), 1, partial_cap(m, r_pad))
    pallas["solve+gram"] = (p_in + p32 + f32 * chunks_gram * r_pad * r_pad, 4 * m * r_pad * r_pad)
  else:
    num_t = r_pad // BN_GRAM
    chunks_gram, _ = row_chunks(-(-m // BM), num_t * (num_t + 1) // 2, partial_cap(m, r_pad))
    pallas["solve+gram"] = (
        p_in + 2 * p32 + f32 * chunks_gram * r_pad * r_pad, tri_flops + m * r_pad * (r_pad + BN_GRAM))
  pallas["solve"] = (2 * p32, tri_flops)
  pallas["rng_ops"] = (0, 20 * k * m * num_rt)
  xla = {
      "sketch": (2 * f32 * k * m + p_in + f32 * k * r, 2 * k * m * r),
      "solve+gram": (p_in + 2 * p32 + f32 * r * r, 3 * m * r * r),
      "solve": (2 * p32, m * r * r),
  }
  return {"pallas": pallas, "xla": xla}
