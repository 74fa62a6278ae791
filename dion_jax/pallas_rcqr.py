"""Pallas GPU kernels for the heavy passes of randomized Cholesky QR.

``dion_jax.orthogonalize.rcqr`` makes three passes over the tall P (m x r):

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

Counted per matrix (``counted_costs`` computes them; ``python benchmarks/gpu_rcqr.py
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

Backend: Triton (``jax.experimental.pallas.triton``). It runs on Ampere and
Hopper, lowers on a CPU-only machine (so CI proves the kernels compile to GPU
IR), and its tile model fits these small-tile streaming matmuls. Mosaic GPU
would only run on Hopper and newer. Triton lowering is deprecated upstream from
jax 0.11: moving to Mosaic GPU means rewriting the four kernel bodies in this one
module; nothing else imports Pallas.

``interpret=None`` runs the kernels in Pallas' interpreter unless the default
backend is a GPU, so ``rcqr(..., backend="pallas")`` also runs (slowly) on CPU.
Every public function works under ``jax.jit`` and ``jax.vmap``: a ``custom_vmap``
folds vmapped axes into the kernels' own batch grid axis, so any number of
nested vmaps gives one kernel launch with a three-dimensional grid. Inside
``shard_map`` the outputs vary over the mesh axes their inputs vary over; the
compiled kernels accept ``check_vma=True``, but jax 0.10's Pallas interpreter
rejects varying inputs, so interpret-mode runs inside ``shard_map`` need
``check_vma=False``.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dion_jax import sketch

# Tile sizes. Triton tiles are powers of two; rows of P are masked, r is padded.
_BM = 32  # rows of P per inner step (the contraction of the sketch and the Gram)
_BK_SKETCH = 64  # sketch rows per program
_BN_SKETCH = 128  # columns of P per sketch program (S is regenerated per r-tile)
_BM_SOLVE, _BN_SOLVE, _BK_SOLVE = 64, 64, 32
_BN_GRAM = 64
_FUSED_MAX_R = 128  # largest padded r whose r x r Gram fits in registers
_TARGET_PROGRAMS = 264  # two waves on an H100's 132 SMs: fixes the row-chunk counts
_NUM_WARPS = 4


def _use_interpret(interpret: bool | None) -> bool:
  return jax.default_backend() != "gpu" if interpret is None else interpret


def _precision(interpret: bool):
  # TF32x3 keeps float32 accuracy on tensor cores; the CPU interpreter only has IEEE float32.
  if interpret:
    return lax.DotAlgorithmPreset.F32_F32_F32
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot(a, b, precision, contract_a: int = 1):
  return lax.dot_general(
      a, b, (((contract_a,), (0,)), ((), ())), precision=precision,
      preferred_element_type=jnp.float32)


def _round_up(x: int, n: int) -> int:
  return -(-x // n) * n


def _padded_r(r: int) -> int:
  """r padded to a power of two ≥ 16 when the fused path takes it, else to the tile width."""
  if r <= _FUSED_MAX_R:
    return max(16, pl.next_power_of_2(r))
  return _round_up(r, _BN_SOLVE)


def _chunks(num_blocks: int, tiles: int, cap: int) -> tuple[int, int]:
  """(chunks, row blocks per chunk) splitting ``num_blocks`` for about _TARGET_PROGRAMS programs."""
  want = max(1, min(num_blocks, cap, -(-_TARGET_PROGRAMS // tiles)))
  steps = -(-num_blocks // want)
  return -(-num_blocks // steps), steps


def _partial_cap(m: int, rows_out: int) -> int:
  """Most row chunks whose float32 partial sums (rows_out x r each) stay within 1/4 of P's float32 bytes."""
  return max(1, m // (4 * rows_out))


def _varying_alike(*inputs):
  """Inputs cast to vary over the union of their varying mesh axes, and that union's type.

  Inside a ``shard_map`` (with vma checks) a kernel's inputs must vary over the same
  axes, and its outputs vary over them too; outside one this is the identity.
  """
  mats = [jax.typeof(x).mat for x in inputs]
  varying = frozenset().union(*(mat.varying for mat in mats))
  cast = [
      x if mat.varying == varying else lax.pcast(x, tuple(sorted(varying - mat.varying)), to="varying")
      for x, mat in zip(inputs, mats)]
  return cast, mats[0].update(varying=varying)


def _f32_out(shape, mat) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=mat)


def _compiler_params(num_warps: int = _NUM_WARPS):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


# --- Batching: kernels take a leading batch axis; vmaps fold into it ----------------


def _stacked(core):
  """Turns ``core(*arrays_with_leading_batch_axis)`` into a vmappable per-matrix function."""

  @custom_batching.custom_vmap
  def batched(*args):
    return core(*args)

  @batched.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
    inner = args[0].shape[1]
    outs = batched(*(a.reshape((axis_size * inner,) + a.shape[2:]) for a in args))
    outs = jax.tree.map(lambda o: o.reshape((axis_size, inner) + o.shape[1:]), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  def per_matrix(*args):
    return jax.tree.map(lambda o: o[0], batched(*(a[None] for a in args)))

  return per_matrix


# --- Sketch product ---------------------------------------------------------------


def _sketch_kernel(seed_ref, p_ref, out_ref, *, m, r, k, steps, num_rt, precision):
  t, c = pl.program_id(1), pl.program_id(2)
  kt, rt = t // num_rt, t % num_rt
  seed, row_start = seed_ref[0], seed_ref[1]
  i_k = (kt * _BK_SKETCH + jnp.arange(_BK_SKETCH, dtype=jnp.int32))[:, None].astype(jnp.uint32)
  cols = rt * _BN_SKETCH + jnp.arange(_BN_SKETCH, dtype=jnp.int32)

  def body(step, acc_kxn):
    start = (c * steps + step) * _BM
    rows = start + jnp.arange(_BM, dtype=jnp.int32)
    mask = (rows[:, None] < m) & (cols[None, :] < r)
    p_bxn = plgpu.load(p_ref.at[pl.ds(start, _BM), pl.ds(rt * _BN_SKETCH, _BN_SKETCH)], mask=mask, other=0)
    j = row_start + rows[None, :].astype(jnp.uint32)
    s_kxb = sketch.sketch_entries(seed, j, i_k)
    return acc_kxn + _dot(s_kxb, p_bxn.astype(jnp.float32), precision)

  acc_kxn = lax.fori_loop(0, steps, body, jnp.zeros((_BK_SKETCH, _BN_SKETCH), jnp.float32))
  out_ref[...] = acc_kxn * np.float32(1.0 / math.sqrt(k))


@functools.lru_cache(maxsize=None)
def _sketch_fn(k: int, interpret: bool):
  def core(P_bxmxr, seeds_bx2):
    B, m, r = P_bxmxr.shape
    num_kt = -(-k // _BK_SKETCH)
    num_rt = -(-r // _BN_SKETCH)
    chunks, steps = _chunks(-(-m // _BM), B * num_kt * num_rt, _partial_cap(m, k))
    inputs, mat = _varying_alike(seeds_bx2, P_bxmxr)
    kernel = functools.partial(
        _sketch_kernel, m=m, r=r, k=k, steps=steps, num_rt=num_rt, precision=_precision(interpret))
    partial_bxcxkxr = pl.pallas_call(
        kernel,
        grid=(B, num_kt * num_rt, chunks),
        in_specs=[
            pl.BlockSpec((None, 2), lambda b, t, c: (b, 0)),
            pl.BlockSpec((None, m, r), lambda b, t, c: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec(
            (None, None, _BK_SKETCH, _BN_SKETCH), lambda b, t, c: (b, c, t // num_rt, t % num_rt)),
        out_shape=_f32_out((B, chunks, num_kt * _BK_SKETCH, num_rt * _BN_SKETCH), mat),
        compiler_params=_compiler_params(),
        interpret=interpret,
        name="rcqr_sketch_product",
    )(*inputs)
    return partial_bxcxkxr.sum(axis=1)[:, :k, :r]

  return _stacked(core)


def sketch_product(
    P_mxr: jax.Array, seed: jax.Array, k: int, row_start: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
  """``S[:, row_start:row_start+m] @ P`` with S from ``dion_jax.sketch``, generated in-kernel; (k, r) float32."""
  seeds = jnp.stack([jnp.asarray(seed).astype(jnp.uint32), jnp.asarray(row_start).astype(jnp.uint32)])
  return _sketch_fn(k, _use_interpret(interpret))(P_mxr, seeds)


# --- Multiplication by a triangular inverse, and the Gram ---------------------------


def _upper_inverse_padded(R_bxrxr: jax.Array, r_pad: int) -> jax.Array:
  r = R_bxrxr.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(r, dtype=jnp.float32), R_bxrxr.shape)
  Rinv = lax.linalg.triangular_solve(R_bxrxr.astype(jnp.float32), eye, left_side=True, lower=False)
  return jnp.pad(Rinv, ((0, 0), (0, r_pad - r), (0, r_pad - r)))


def _solve_kernel(p_ref, rinv_ref, out_ref, *, m, r, precision):
  i, j = pl.program_id(1), pl.program_id(2)
  rows = i * _BM_SOLVE + jnp.arange(_BM_SOLVE, dtype=jnp.int32)
  out_cols = j * _BN_SOLVE + jnp.arange(_BN_SOLVE, dtype=jnp.int32)

  def body(kb, acc_mxn):
    cols = kb * _BK_SOLVE + jnp.arange(_BK_SOLVE, dtype=jnp.int32)
    mask = (rows[:, None] < m) & (cols[None, :] < r)
    p = plgpu.load(p_ref.at[pl.ds(i * _BM_SOLVE, _BM_SOLVE), pl.ds(kb * _BK_SOLVE, _BK_SOLVE)], mask=mask, other=0)
    rinv = rinv_ref[pl.ds(kb * _BK_SOLVE, _BK_SOLVE), pl.ds(j * _BN_SOLVE, _BN_SOLVE)]
    return acc_mxn + _dot(p.astype(jnp.float32), rinv, precision)

  # R⁻¹ is upper triangular: rows of it below this column tile's end are zero.
  num_kb = (j + 1) * (_BN_SOLVE // _BK_SOLVE)
  acc_mxn = lax.fori_loop(0, num_kb, body, jnp.zeros((_BM_SOLVE, _BN_SOLVE), jnp.float32))
  mask = (rows[:, None] < m) & (out_cols[None, :] < r)
  plgpu.store(out_ref.at[pl.ds(i * _BM_SOLVE, _BM_SOLVE), pl.ds(j * _BN_SOLVE, _BN_SOLVE)], acc_mxn, mask=mask)


def _tri_matmul(P_bxmxr, Rinv_bxrxr, interpret):
  B, m, r = P_bxmxr.shape
  r_pad = Rinv_bxrxr.shape[-1]
  inputs, mat = _varying_alike(P_bxmxr, Rinv_bxrxr)
  kernel = functools.partial(_solve_kernel, m=m, r=r, precision=_precision(interpret))
  return pl.pallas_call(
      kernel,
      grid=(B, -(-m // _BM_SOLVE), r_pad // _BN_SOLVE),
      in_specs=[
          pl.BlockSpec((None, m, r), lambda b, i, j: (b, 0, 0)),
          pl.BlockSpec((None, r_pad, r_pad), lambda b, i, j: (b, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, m, r), lambda b, i, j: (b, 0, 0)),
      out_shape=_f32_out((B, m, r), mat),
      compiler_params=_compiler_params(),
      interpret=interpret,
      name="rcqr_triangular_matmul",
  )(*inputs)


def _gram_kernel(p_ref, out_ref, *, m, r, steps, num_t, precision):
  c, t = pl.program_id(1), pl.program_id(2)
  j, l = t // num_t, t % num_t
  cols_j = j * _BN_GRAM + jnp.arange(_BN_GRAM, dtype=jnp.int32)
  cols_l = l * _BN_GRAM + jnp.arange(_BN_GRAM, dtype=jnp.int32)

  def body(step, acc_nxn):
    start = (c * steps + step) * _BM
    rows = (start + jnp.arange(_BM, dtype=jnp.int32))[:, None]
    a = plgpu.load(p_ref.at[pl.ds(start, _BM), pl.ds(j * _BN_GRAM, _BN_GRAM)],
                   mask=(rows < m) & (cols_j[None, :] < r), other=0)
    b = plgpu.load(p_ref.at[pl.ds(start, _BM), pl.ds(l * _BN_GRAM, _BN_GRAM)],
                   mask=(rows < m) & (cols_l[None, :] < r), other=0)
    return acc_nxn + _dot(a, b, precision, contract_a=0)

  # Only the upper-triangular tiles are computed; the lower ones are written as zeros.
  acc_nxn = lax.fori_loop(
      0, jnp.where(j <= l, steps, 0), body, jnp.zeros((_BN_GRAM, _BN_GRAM), jnp.float32))
  out_ref[...] = acc_nxn


def _gram(P1_bxmxr, r_pad, interpret):
  B, m, r = P1_bxmxr.shape
  num_t = r_pad // _BN_GRAM
  chunks, steps = _chunks(-(-m // _BM), B * num_t * (num_t + 1) // 2, _partial_cap(m, r_pad))
  kernel = functools.partial(
      _gram_kernel, m=m, r=r, steps=steps, num_t=num_t, precision=_precision(interpret))
  upper_bxcxrxr = pl.pallas_call(
      kernel,
      grid=(B, chunks, num_t * num_t),
      in_specs=[pl.BlockSpec((None, m, r), lambda b, c, t: (b, 0, 0))],
      out_specs=pl.BlockSpec(
          (None, None, _BN_GRAM, _BN_GRAM), lambda b, c, t: (b, c, t // num_t, t % num_t)),
      out_shape=_f32_out((B, chunks, r_pad, r_pad), jax.typeof(P1_bxmxr).mat),
      compiler_params=_compiler_params(),
      interpret=interpret,
      name="rcqr_gram_upper",
  )(P1_bxmxr)
  return upper_bxcxrxr.sum(axis=1)


def _fused_kernel(p_ref, rinv_ref, p1_ref, gram_ref, *, m, r, steps, precision):
  c = pl.program_id(1)
  r_pad = rinv_ref.shape[-1]
  cols = jnp.arange(r_pad, dtype=jnp.int32)[None, :]
  rinv = rinv_ref[...]

  def body(step, gram_rxr):
    start = (c * steps + step) * _BM
    rows = (start + jnp.arange(_BM, dtype=jnp.int32))[:, None]
    mask = (rows < m) & (cols < r)
    p = plgpu.load(p_ref.at[pl.ds(start, _BM), pl.ds(0, r_pad)], mask=mask, other=0)
    p1 = _dot(p.astype(jnp.float32), rinv, precision)
    plgpu.store(p1_ref.at[pl.ds(start, _BM), pl.ds(0, r_pad)], p1, mask=mask)
    return gram_rxr + _dot(p1, p1, precision, contract_a=0)

  gram_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros((r_pad, r_pad), jnp.float32))


def _fused_solve_and_gram(P_bxmxr, Rinv_bxrxr, interpret):
  B, m, r = P_bxmxr.shape
  r_pad = Rinv_bxrxr.shape[-1]
  chunks, steps = _chunks(-(-m // _BM), B, _partial_cap(m, r_pad))
  inputs, mat = _varying_alike(P_bxmxr, Rinv_bxrxr)
  kernel = functools.partial(_fused_kernel, m=m, r=r, steps=steps, precision=_precision(interpret))
  P1_bxmxr, gram_bxcxrxr = pl.pallas_call(
      kernel,
      grid=(B, chunks),
      in_specs=[
          pl.BlockSpec((None, m, r), lambda b, c: (b, 0, 0)),
          pl.BlockSpec((None, r_pad, r_pad), lambda b, c: (b, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, m, r), lambda b, c: (b, 0, 0)),
          pl.BlockSpec((None, None, r_pad, r_pad), lambda b, c: (b, c, 0, 0)),
      ],
      out_shape=[
          _f32_out((B, m, r), mat),
          _f32_out((B, chunks, r_pad, r_pad), mat),
      ],
      compiler_params=_compiler_params(num_warps=8),
      interpret=interpret,
      name="rcqr_solve_and_gram",
  )(*inputs)
  return P1_bxmxr, gram_bxcxrxr.sum(axis=1)


@functools.lru_cache(maxsize=None)
def _solve_and_gram_fn(interpret: bool):
  def core(P_bxmxr, R_bxrxr):
    r = P_bxmxr.shape[-1]
    r_pad = _padded_r(r)
    Rinv_bxrxr = _upper_inverse_padded(R_bxrxr, r_pad)
    if r_pad <= _FUSED_MAX_R:
      P1_bxmxr, G_bxrxr = _fused_solve_and_gram(P_bxmxr, Rinv_bxrxr, interpret)
    else:
      P1_bxmxr = _tri_matmul(P_bxmxr, Rinv_bxrxr, interpret)
      upper_bxrxr = jnp.triu(_gram(P1_bxmxr, r_pad, interpret))
      G_bxrxr = upper_bxrxr + jnp.swapaxes(jnp.triu(upper_bxrxr, 1), -1, -2)
    return P1_bxmxr, G_bxrxr[:, :r, :r]

  return _stacked(core)


@functools.lru_cache(maxsize=None)
def _solve_fn(interpret: bool):
  def core(P_bxmxr, R_bxrxr):
    r_pad = _round_up(max(P_bxmxr.shape[-1], _BN_SOLVE), _BN_SOLVE)
    return _tri_matmul(P_bxmxr, _upper_inverse_padded(R_bxrxr, r_pad), interpret)

  return _stacked(core)


def solve_and_gram(
    P_mxr: jax.Array, R_rxr: jax.Array, *, interpret: bool | None = None
) -> tuple[jax.Array, jax.Array]:
  """``P₁ = P R⁻¹`` (float32, R upper triangular) and its Gram matrix ``P₁ᵀ P₁`` (r, r)."""
  return _solve_and_gram_fn(_use_interpret(interpret))(P_mxr, R_rxr)


def solve(P_mxr: jax.Array, R_rxr: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """``P R⁻¹`` in float32 for upper-triangular R."""
  return _solve_fn(_use_interpret(interpret))(P_mxr, R_rxr)


# --- Counted costs ------------------------------------------------------------------


def counted_costs(m: int, r: int, k: int, itemsize: int) -> dict[str, dict[str, tuple[int, int]]]:
  """Bytes moved and flops per pass, ``{"pallas"|"xla": {pass: (bytes, flops)}}``, one matrix.

  Bytes count reads and writes of HBM arrays by each kernel, without cache reuse of
  tiles (re-reads of P by several r-tiles are assumed to hit L2). Flops count
  multiply-adds as two; the sketch's ~20 integer ops per generated
  entry are listed separately as ``rng_ops`` under ``"pallas"``.
  """
  f32 = 4
  num_rt = -(-r // _BN_SKETCH)
  chunks_sketch, _ = _chunks(-(-m // _BM), -(-k // _BK_SKETCH) * num_rt, _partial_cap(m, k))
  r_pad = _padded_r(r)
  r_solve = _round_up(max(r, _BN_SOLVE), _BN_SOLVE)
  p_in, p32 = itemsize * m * r, f32 * m * r
  # Flops as executed: padded tiles, and only the tiles on or above R⁻¹'s diagonal.
  tri_flops = m * r_solve * (r_solve + _BN_SOLVE)
  pallas = {"sketch": (p_in + f32 * chunks_sketch * k * r, 2 * k * m * num_rt * _BN_SKETCH)}
  if r_pad <= _FUSED_MAX_R:
    chunks_gram, _ = _chunks(-(-m // _BM), 1, _partial_cap(m, r_pad))
    pallas["solve+gram"] = (p_in + p32 + f32 * chunks_gram * r_pad * r_pad, 4 * m * r_pad * r_pad)
  else:
    num_t = r_pad // _BN_GRAM
    chunks_gram, _ = _chunks(-(-m // _BM), num_t * (num_t + 1) // 2, _partial_cap(m, r_pad))
    pallas["solve+gram"] = (
        p_in + 2 * p32 + f32 * chunks_gram * r_pad * r_pad, tri_flops + m * r_pad * (r_pad + _BN_GRAM))
  pallas["solve"] = (2 * p32, tri_flops)
  pallas["rng_ops"] = (0, 20 * k * m * num_rt)
  xla = {
      "sketch": (2 * f32 * k * m + p_in + f32 * k * r, 2 * k * m * r),
      "solve+gram": (p_in + 2 * p32 + f32 * r * r, 3 * m * r * r),
      "solve": (2 * p32, m * r * r),
  }
  return {"pallas": pallas, "xla": xla}
