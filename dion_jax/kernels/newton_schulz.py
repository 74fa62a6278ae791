"""Pallas GPU kernels for the symmetric products of the polar iterations.

Each step of ``dion_jax.linalg.polar`` on a wide X (s x l, s <= l) computes

    A = X Xᵀ                 (s x s)   2 s² l flops in XLA
    B = b·A + c·A²           (s x s)   2 s³ flops in XLA
    X ← a·X + B X

A and B are symmetric, so only their tiles on and above the diagonal are needed:
``symmetric_products`` computes those (about s² l and s³ flops, plus the diagonal
tiles' other halves) in two kernels and mirrors them in XLA, as the reference's
Triton ``ns_line_1`` / ``ns_line_2`` do. ``B X`` stays a plain XLA matmul.

The kernels read X (and A) from memory by (64 x 32) tiles with float32
accumulation; X is zero-padded to whole tiles first (zero rows and columns leave the
products of the real ones unchanged). bfloat16 X gives bfloat16 A and B, as XLA's
einsum; float32 X uses TF32x3 on tensor cores (float32 accuracy), IEEE float32 in the
interpreter. ``newton_schulz_xla.xla_symmetric_products`` is the XLA composition of
the same products, the fallback; ``interpret=None`` interprets unless the default
backend is a GPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dion_jax.kernels.pallas_common import (
  compiler_params,
  matmul_precision,
  round_up,
  upper_tile_steps,
  use_interpret,
)  # fmt: skip

_BT = 64  # output tile (rows and columns of A and B)
_BK = 32  # contraction step


def _dot(x, y, contract_y: int, dtype_precision):
  return lax.dot_general(
      x, y, (((1,), (contract_y,)), ((), ())), precision=dtype_precision, preferred_element_type=jnp.float32
  )


def _gram_kernel(x_ref, a_ref, *, steps, num_t, precision):
  """A's tile (i, j), i <= j: Σ_l X[i-tile, l] X[j-tile, l]; tiles below the diagonal: 0."""
  t = pl.program_id(1)
  i, j = t // num_t, t % num_t

  def body(step, acc):
    xi = x_ref[pl.ds(i * _BT, _BT), pl.ds(step * _BK, _BK)]
    xj = x_ref[pl.ds(j * _BT, _BT), pl.ds(step * _BK, _BK)]
    return acc + _dot(xi, xj, 1, precision)

  acc = lax.fori_loop(*upper_tile_steps(i <= j, steps), body, jnp.zeros((_BT, _BT), jnp.float32))
  a_ref[...] = acc.astype(a_ref.dtype)


def _square_kernel(a_ref, out_ref, *, steps, num_t, b, c, precision):
  """B's tile (i, j), i <= j: b·A[i, j] + c·Σ_k A[i, k] A[k, j]; below the diagonal: 0."""
  t = pl.program_id(1)
  i, j = t // num_t, t % num_t

  def body(step, acc):
    a_ik = a_ref[pl.ds(i * _BT, _BT), pl.ds(step * _BK, _BK)]
    a_kj = a_ref[pl.ds(step * _BK, _BK), pl.ds(j * _BT, _BT)]
    return acc + _dot(a_ik, a_kj, 0, precision)

  acc = lax.fori_loop(*upper_tile_steps(i <= j, steps), body, jnp.zeros((_BT, _BT), jnp.float32))
  a_ij = a_ref[pl.ds(i * _BT, _BT), pl.ds(j * _BT, _BT)].astype(jnp.float32)
  out = jnp.where(i <= j, b * a_ij + c * acc, 0.0)
  out_ref[...] = out.astype(out_ref.dtype)


def _mirror(upper_bxsxs: jax.Array) -> jax.Array:
  """The symmetric matrix whose tiles on and above the diagonal are ``upper``'s."""
  tile = jnp.arange(upper_bxsxs.shape[-1]) // _BT
  above = tile[:, None] <= tile[None, :]
  return jnp.where(above, upper_bxsxs, jnp.swapaxes(upper_bxsxs, -1, -2))


def _tiled_call(kernel, x, out_s, steps, num_t, name, interpret, **params):
  B = x.shape[0]
  mat = jax.typeof(x).mat
  return pl.pallas_call(
      functools.partial(kernel, steps=steps, num_t=num_t, **params),
      grid=(B, num_t * num_t),
      in_specs=[pl.BlockSpec((None,) + x.shape[1:], lambda b, t: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, _BT, _BT), lambda b, t: (b, t // num_t, t % num_t)),
      out_shape=jax.ShapeDtypeStruct((B, out_s, out_s), x.dtype, manual_axis_type=mat),
      compiler_params=compiler_params(),
      interpret=interpret,
      name=name,
  )(x)


def symmetric_products(
    X_bxsxl: jax.Array, b: float, c: float, precision=None, *, interpret: bool | None = None
) -> jax.Array:
  """``B = b·A + c·A²`` with ``A = X Xᵀ`` from the upper tiles only; (B, s, s) in X's dtype.

  ``precision`` is accepted for the XLA path's signature; the kernels pick their own
  (module docstring).
  """
  del precision
  interpret = use_interpret(interpret)
  _, s, l = X_bxsxl.shape
  s_pad, l_pad = round_up(s, _BT), round_up(l, _BK)
  X = jnp.pad(X_bxsxl, ((0, 0), (0, s_pad - s), (0, l_pad - l)))
  dot_precision = matmul_precision(interpret) if X.dtype == jnp.float32 else None
  num_t = s_pad // _BT
  A = _mirror(_tiled_call(_gram_kernel, X, s_pad, l_pad // _BK, num_t, "ns_gram", interpret, precision=dot_precision))
  B = _tiled_call(
      _square_kernel, A, s_pad, s_pad // _BK, num_t, "ns_square", interpret, b=b, c=c, precision=dot_precision
  )
  return _mirror(B)[:, :s, :s]


def counted_flops(s: int, l: int) -> dict[str, int]:
  """Flops of A and B per matrix: the kernels' (upper tiles, padding included) and XLA's."""
  s_pad, l_pad = round_up(s, _BT), round_up(l, _BK)
  tiles = (s_pad // _BT) * (s_pad // _BT + 1) // 2
  return {"pallas": tiles * 2 * _BT * _BT * (l_pad + s_pad), "xla": 2 * s * s * l + 2 * s**3}
