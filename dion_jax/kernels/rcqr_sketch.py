"""RCQR's sketch product S P with S generated in the kernel (see ``dion_jax.kernels.rcqr``)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dion_jax.kernels import sketch
from dion_jax.kernels.pallas_common import (
  BK_SKETCH,
  BM,
  BN_SKETCH,
  compiler_params,
  f32_out,
  matmul_precision,
  partial_cap,
  row_chunks,
  stacked_kernel,
  tile_dot,
  use_interpret,
  varying_alike,
)  # fmt: skip


def _sketch_kernel(seed_ref, p_ref, out_ref, *, m, r, k, steps, num_rt, precision):
  t, c = pl.program_id(1), pl.program_id(2)
  kt, rt = t // num_rt, t % num_rt
  seed, row_start = seed_ref[0], seed_ref[1]
  i_k = (kt * BK_SKETCH + jnp.arange(BK_SKETCH, dtype=jnp.int32))[:, None].astype(jnp.uint32)
  cols = rt * BN_SKETCH + jnp.arange(BN_SKETCH, dtype=jnp.int32)

  def body(step, acc_kxn):
    start = (c * steps + step) * BM
    rows = start + jnp.arange(BM, dtype=jnp.int32)
    mask = (rows[:, None] < m) & (cols[None, :] < r)
    p_bxn = plgpu.load(p_ref.at[pl.ds(start, BM), pl.ds(rt * BN_SKETCH, BN_SKETCH)], mask=mask, other=0)
    j = row_start + rows[None, :].astype(jnp.uint32)
    s_kxb = sketch.sketch_entries(seed, j, i_k)
    return acc_kxn + tile_dot(s_kxb, p_bxn.astype(jnp.float32), precision)

  acc_kxn = lax.fori_loop(0, steps, body, jnp.zeros((BK_SKETCH, BN_SKETCH), jnp.float32))
  out_ref[...] = acc_kxn * np.float32(1.0 / math.sqrt(k))


@functools.lru_cache(maxsize=None)
def _sketch_fn(k: int, interpret: bool):
  def core(P_bxmxr, seeds_bx2):
    B, m, r = P_bxmxr.shape
    num_kt = -(-k // BK_SKETCH)
    num_rt = -(-r // BN_SKETCH)
    chunks, steps = row_chunks(-(-m // BM), B * num_kt * num_rt, partial_cap(m, k))
    inputs, mat = varying_alike(seeds_bx2, P_bxmxr)
    kernel = functools.partial(
        _sketch_kernel, m=m, r=r, k=k, steps=steps, num_rt=num_rt, precision=matmul_precision(interpret))
    partial_bxcxkxr = pl.pallas_call(
        kernel,
        grid=(B, num_kt * num_rt, chunks),
        in_specs=[
            pl.BlockSpec((None, 2), lambda b, t, c: (b, 0)),
            pl.BlockSpec((None, m, r), lambda b, t, c: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec(
            (None, None, BK_SKETCH, BN_SKETCH), lambda b, t, c: (b, c, t // num_rt, t % num_rt)),
        out_shape=f32_out((B, chunks, num_kt * BK_SKETCH, num_rt * BN_SKETCH), mat),
        compiler_params=compiler_params(),
        interpret=interpret,
        name="rcqr_sketch_product",
    )(*inputs)
    return partial_bxcxkxr.sum(axis=1)[:, :k, :r]

  return stacked_kernel(core)


def sketch_product(
    P_mxr: jax.Array, seed: jax.Array, k: int, row_start: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
  """``S[:, row_start:row_start+m] @ P``, S (``dion_jax.kernels.sketch``) generated in-kernel; (k, r) float32."""
  seeds = jnp.stack([jnp.asarray(seed).astype(jnp.uint32), jnp.asarray(row_start).astype(jnp.uint32)])
  return _sketch_fn(k, use_interpret(interpret))(P_mxr, seeds)
