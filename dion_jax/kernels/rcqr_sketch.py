"""RCQR's sketch product S P with S generated in the kernel (see ``dion_jax.kernels.rcqr``)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dion_jax import sketch
from dion_jax.kernels.pallas_common import (
    _BK_SKETCH, _BM, _BN_SKETCH, _chunks, _compiler_params, _dot, _f32_out, _partial_cap, _precision,
    _stacked, _use_interpret, _varying_alike,
)  # fmt: skip


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
