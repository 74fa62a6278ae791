"""RCQR's multiplication by a triangular inverse, fused with the Gram P₁ᵀP₁ (see
``dion_jax.kernels.rcqr``)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dion_jax.kernels.pallas_common import (
  BK_SOLVE,
  BM,
  BM_SOLVE,
  BN_GRAM,
  BN_SOLVE,
  FUSED_MAX_R,
  compiler_params,
  f32_out,
  matmul_precision,
  padded_rank,
  partial_cap,
  round_up,
  row_chunks,
  stacked_kernel,
  tile_dot,
  upper_tile_steps,
  use_interpret,
  varying_alike,
)  # fmt: skip


def _upper_inverse_padded(R_bxrxr: jax.Array, r_pad: int) -> jax.Array:
  r = R_bxrxr.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(r, dtype=jnp.float32), R_bxrxr.shape)
  Rinv = lax.linalg.triangular_solve(R_bxrxr.astype(jnp.float32), eye, left_side=True, lower=False)
  return jnp.pad(Rinv, ((0, 0), (0, r_pad - r), (0, r_pad - r)))


def _solve_kernel(p_ref, rinv_ref, out_ref, *, m, r, precision):
  i, j = pl.program_id(1), pl.program_id(2)
  rows = i * BM_SOLVE + jnp.arange(BM_SOLVE, dtype=jnp.int32)
  out_cols = j * BN_SOLVE + jnp.arange(BN_SOLVE, dtype=jnp.int32)

  def body(kb, acc_mxn):
    cols = kb * BK_SOLVE + jnp.arange(BK_SOLVE, dtype=jnp.int32)
    mask = (rows[:, None] < m) & (cols[None, :] < r)
    p = plgpu.load(p_ref.at[pl.ds(i * BM_SOLVE, BM_SOLVE), pl.ds(kb * BK_SOLVE, BK_SOLVE)], mask=mask, other=0)
    rinv = rinv_ref[pl.ds(kb * BK_SOLVE, BK_SOLVE), pl.ds(j * BN_SOLVE, BN_SOLVE)]
    return acc_mxn + tile_dot(p.astype(jnp.float32), rinv, precision)

  # R⁻¹ is upper triangular: rows of it below this column tile's end are zero.
  num_kb = (j + 1) * (BN_SOLVE // BK_SOLVE)
  acc_mxn = lax.fori_loop(0, num_kb, body, jnp.zeros((BM_SOLVE, BN_SOLVE), jnp.float32))
  mask = (rows[:, None] < m) & (out_cols[None, :] < r)
  plgpu.store(out_ref.at[pl.ds(i * BM_SOLVE, BM_SOLVE), pl.ds(j * BN_SOLVE, BN_SOLVE)], acc_mxn, mask=mask)


def _tri_matmul(P_bxmxr, Rinv_bxrxr, interpret):
  B, m, r = P_bxmxr.shape
  r_pad = Rinv_bxrxr.shape[-1]
  inputs, mat = varying_alike(P_bxmxr, Rinv_bxrxr)
  kernel = functools.partial(_solve_kernel, m=m, r=r, precision=matmul_precision(interpret))
  return pl.pallas_call(
      kernel,
      grid=(B, -(-m // BM_SOLVE), r_pad // BN_SOLVE),
      in_specs=[
          pl.BlockSpec((None, m, r), lambda b, i, j: (b, 0, 0)),
          pl.BlockSpec((None, r_pad, r_pad), lambda b, i, j: (b, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, m, r), lambda b, i, j: (b, 0, 0)),
      out_shape=f32_out((B, m, r), mat),
      compiler_params=compiler_params(),
      interpret=interpret,
      name="rcqr_triangular_matmul",
  )(*inputs)


def _gram_kernel(p_ref, out_ref, *, m, r, steps, num_t, precision):
  c, t = pl.program_id(1), pl.program_id(2)
  j, l = t // num_t, t % num_t
  cols_j = j * BN_GRAM + jnp.arange(BN_GRAM, dtype=jnp.int32)
  cols_l = l * BN_GRAM + jnp.arange(BN_GRAM, dtype=jnp.int32)

  def body(step, acc_nxn):
    start = (c * steps + step) * BM
    rows = (start + jnp.arange(BM, dtype=jnp.int32))[:, None]
    a = plgpu.load(p_ref.at[pl.ds(start, BM), pl.ds(j * BN_GRAM, BN_GRAM)],
                   mask=(rows < m) & (cols_j[None, :] < r), other=0)
    b = plgpu.load(p_ref.at[pl.ds(start, BM), pl.ds(l * BN_GRAM, BN_GRAM)],
                   mask=(rows < m) & (cols_l[None, :] < r), other=0)
    return acc_nxn + tile_dot(a, b, precision, contract_a=0)

  # Only the upper-triangular tiles are computed; the lower ones are written as zeros.
  acc_nxn = lax.fori_loop(
      *upper_tile_steps(j <= l, steps), body, jnp.zeros((BN_GRAM, BN_GRAM), jnp.float32))
  out_ref[...] = acc_nxn


def _gram(P1_bxmxr, r_pad, interpret):
  B, m, r = P1_bxmxr.shape
  num_t = r_pad // BN_GRAM
  chunks, steps = row_chunks(-(-m // BM), B * num_t * (num_t + 1) // 2, partial_cap(m, r_pad))
  kernel = functools.partial(
      _gram_kernel, m=m, r=r, steps=steps, num_t=num_t, precision=matmul_precision(interpret))
  upper_bxcxrxr = pl.pallas_call(
      kernel,
      grid=(B, chunks, num_t * num_t),
      in_specs=[pl.BlockSpec((None, m, r), lambda b, c, t: (b, 0, 0))],
      out_specs=pl.BlockSpec(
          (None, None, BN_GRAM, BN_GRAM), lambda b, c, t: (b, c, t // num_t, t % num_t)),
      out_shape=f32_out((B, chunks, r_pad, r_pad), jax.typeof(P1_bxmxr).mat),
      compiler_params=compiler_params(),
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
    start = (c * steps + step) * BM
    rows = (start + jnp.arange(BM, dtype=jnp.int32))[:, None]
    mask = (rows < m) & (cols < r)
    p = plgpu.load(p_ref.at[pl.ds(start, BM), pl.ds(0, r_pad)], mask=mask, other=0)
    p1 = tile_dot(p.astype(jnp.float32), rinv, precision)
    plgpu.store(p1_ref.at[pl.ds(start, BM), pl.ds(0, r_pad)], p1, mask=mask)
    return gram_rxr + tile_dot(p1, p1, precision, contract_a=0)

  gram_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros((r_pad, r_pad), jnp.float32))


def _fused_solve_and_gram(P_bxmxr, Rinv_bxrxr, interpret):
  B, m, r = P_bxmxr.shape
  r_pad = Rinv_bxrxr.shape[-1]
  chunks, steps = row_chunks(-(-m // BM), B, partial_cap(m, r_pad))
  inputs, mat = varying_alike(P_bxmxr, Rinv_bxrxr)
  kernel = functools.partial(_fused_kernel, m=m, r=r, steps=steps, precision=matmul_precision(interpret))
  # P's and P₁'s blocks are r_pad wide, past the arrays' r columns (masked in the kernel), so
  # that the kernel's (BM, r_pad) tiles lie inside its blocks: jax 0.12 rejects a slice that
  # runs past its block from a static start.
  P1_bxmxr, gram_bxcxrxr = pl.pallas_call(
      kernel,
      grid=(B, chunks),
      in_specs=[
          pl.BlockSpec((None, m, r_pad), lambda b, c: (b, 0, 0)),
          pl.BlockSpec((None, r_pad, r_pad), lambda b, c: (b, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, m, r_pad), lambda b, c: (b, 0, 0)),
          pl.BlockSpec((None, None, r_pad, r_pad), lambda b, c: (b, c, 0, 0)),
      ],
      out_shape=[
          f32_out((B, m, r), mat),
          f32_out((B, chunks, r_pad, r_pad), mat),
      ],
      compiler_params=compiler_params(num_warps=8),
      interpret=interpret,
      name="rcqr_solve_and_gram",
  )(*inputs)
  return P1_bxmxr, gram_bxcxrxr.sum(axis=1)


@functools.lru_cache(maxsize=None)
def _solve_and_gram_fn(interpret: bool):
  def core(P_bxmxr, R_bxrxr):
    r = P_bxmxr.shape[-1]
    r_pad = padded_rank(r)
    Rinv_bxrxr = _upper_inverse_padded(R_bxrxr, r_pad)
    if r_pad <= FUSED_MAX_R:
      P1_bxmxr, G_bxrxr = _fused_solve_and_gram(P_bxmxr, Rinv_bxrxr, interpret)
    else:
      P1_bxmxr = _tri_matmul(P_bxmxr, Rinv_bxrxr, interpret)
      upper_bxrxr = jnp.triu(_gram(P1_bxmxr, r_pad, interpret))
      G_bxrxr = upper_bxrxr + jnp.swapaxes(jnp.triu(upper_bxrxr, 1), -1, -2)
    return P1_bxmxr, G_bxrxr[:, :r, :r]

  return stacked_kernel(core)


@functools.lru_cache(maxsize=None)
def _solve_fn(interpret: bool):
  def core(P_bxmxr, R_bxrxr):
    r_pad = round_up(max(P_bxmxr.shape[-1], BN_SOLVE), BN_SOLVE)
    return _tri_matmul(P_bxmxr, _upper_inverse_padded(R_bxrxr, r_pad), interpret)

  return stacked_kernel(core)


def solve_and_gram(
    P_mxr: jax.Array, R_rxr: jax.Array, *, interpret: bool | None = None
) -> tuple[jax.Array, jax.Array]:
  """``P₁ = P R⁻¹`` (float32, R upper triangular) and its Gram matrix ``P₁ᵀ P₁`` (r, r)."""
  return _solve_and_gram_fn(use_interpret(interpret))(P_mxr, R_rxr)


def solve(P_mxr: jax.Array, R_rxr: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """``P R⁻¹`` in float32 for upper-triangular R."""
  return _solve_fn(use_interpret(interpret))(P_mxr, R_rxr)
