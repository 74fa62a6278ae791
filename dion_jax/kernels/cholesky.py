"""Pallas GPU kernel: the Cholesky factor and its inverse of a whole batch of small matrices in one launch.

For a batch of symmetric positive definite A (B, n, n), n a power of two ≤ ``MAX_N``,
``cholesky_and_inverse`` returns the lower-triangular L with A = L Lᵀ and X = L⁻¹, float32.
Each program holds one matrix's A and X in registers and runs the n steps of
``cholesky_xla.elimination_step`` on them (right-looking Cholesky, column-oriented forward
substitution; L takes A's place): about 10n³ elementwise operations (per step a masked
read of a column and of a row and two rank-1 updates), no memory traffic but one read of
A and one write of L and of X.
Columns and rows are read by masked sums, exact since every other term is zero. The grid
is the batch, so one launch factors every matrix of a megabatch, where cuSOLVER's batched
Cholesky (jaxlib's ``cusolver_potrf_ffi``) takes about 2n/16 launches and a triangular
inverse (cuBLAS's batched trsm) n/64 more (``dion_jax.linalg.cholesky``).

``dion_jax.kernels.cholesky_xla`` is the XLA composition of the same steps, the fallback;
``interpret=None`` interprets unless the default backend is a GPU.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dion_jax.kernels.cholesky_xla import elimination_step
from dion_jax.kernels.pallas_common import compiler_params, f32_out, use_interpret

MAX_N = 128  # two (n x n) float32 tiles in the registers of 8 warps: 128 values per thread
_NUM_WARPS = 8


def _kernel(a_ref, l_ref, x_ref, *, n):
  rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  column = lambda M, j: jnp.sum(jnp.where(cols == j, M, 0.0), axis=1)
  row = lambda M, j: jnp.sum(jnp.where(rows == j, M, 0.0), axis=0)
  A = a_ref[...].astype(jnp.float32)
  X = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)
  L, X = lax.fori_loop(jnp.int32(0), jnp.int32(n), lambda j, c: elimination_step(j, *c, column, row), (A, X))
  l_ref[...] = L
  x_ref[...] = X


def cholesky_and_inverse(A_bxnxn: jax.Array, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """``(L, X)``: L = chol(A) and X = L⁻¹ (lower triangular) of every matrix of (B, n, n);
  float32, each (B, n, n).

  Vmapped, the extra axes become axes of the grid (Pallas' batching rule): still one launch.
  """
  B, n, _ = A_bxnxn.shape
  if n > MAX_N or n & (n - 1):
    raise ValueError(f"cholesky_and_inverse takes n a power of two up to {MAX_N}, got {n}")
  return pl.pallas_call(
      functools.partial(_kernel, n=n),
      grid=(B,),
      in_specs=[pl.BlockSpec((None, n, n), lambda b: (b, 0, 0))],
      out_specs=[pl.BlockSpec((None, n, n), lambda b: (b, 0, 0))] * 2,
      out_shape=[f32_out((B, n, n), jax.typeof(A_bxnxn).mat)] * 2,
      compiler_params=compiler_params(num_warps=_NUM_WARPS),
      interpret=use_interpret(interpret),
      name="cholesky_and_inverse",
  )(A_bxnxn)
