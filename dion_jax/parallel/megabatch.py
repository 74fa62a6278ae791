"""Whole matrices from sharded blocks, one device per matrix, inside ``shard_map``.

Muon-like optimizers need each matrix whole. A batch of B same-shaped matrices whose
two matrix axes are split over mesh axes ``names_a`` (N_a devices) and ``names_b``
(N_b devices) lies as a (B, a/N_a, b/N_b) block on each device of the group of
N = N_a·N_b devices. :func:`gather` pads B to a multiple of N with zero matrices and
runs two all-to-alls,

    (B, a/N_a, b/N_b) --all_to_all(names_a)--> (B/N_a, a, b/N_b)
                      --all_to_all(names_b)--> (B/N, a, b),

so each device of the group holds B/N whole matrices: each device sends and receives
(N−1)/N of its block, never every matrix (an all-gather would put all B on every
device and repeat the work N times). :func:`scatter` is the inverse. This is
microsoft/dion's "megabatch" communication, written with JAX collectives.

Zero matrices (the padding) stay zero under the polar iterations of ``dion_jax.linalg.polar``.

16-bit floats travel as their uint16 bit patterns: XLA's CPU backend widens bfloat16
collectives to float32 (twice the bytes); integers it leaves alone, on every backend.
"""

import math

import jax
import jax.numpy as jnp

from dion_jax.parallel.collectives import axis_size

Names = tuple[str, ...]


def _padded_to_group(x: jax.Array, n: int) -> jax.Array:
  """``x`` with zero matrices appended so that its batch divides by ``n``."""
  pad = math.ceil(x.shape[0] / n) * n - x.shape[0]
  return jnp.pad(x, ((0, pad), (0, 0), (0, 0))) if pad else x


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _unbits(x: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def gather(x_bxaxb: jax.Array, names_a: Names, names_b: Names) -> jax.Array:
  """This device's share of whole matrices: (ceil(B/N), a, b) (module docstring)."""
  x = _bits(_padded_to_group(x_bxaxb, axis_size(names_a) * axis_size(names_b)))
  if names_a:
    x = jax.lax.all_to_all(x, names_a, 0, 1, tiled=True)
  if names_b:
    x = jax.lax.all_to_all(x, names_b, 0, 2, tiled=True)
  return _unbits(x, x_bxaxb.dtype)


def scatter(y: jax.Array, names_a: Names, names_b: Names, batch: int) -> jax.Array:
  """Inverse of :func:`gather`: whole matrices back to (batch, a/N_a, b/N_b) blocks."""
  dtype, y = y.dtype, _bits(y)
  if names_b:
    y = jax.lax.all_to_all(y, names_b, 2, 0, tiled=True)
  if names_a:
    y = jax.lax.all_to_all(y, names_a, 1, 0, tiled=True)
  return _unbits(y[:batch], dtype)


def reduce_to_owner(x_bxkxl: jax.Array, names_sum: Names, names_l: Names) -> jax.Array:
  """Whole (k x l) matrices from blocks that are *parts of a sum* over ``names_sum``.

  Each device of ``names_sum`` holds the rows it owns and zeros elsewhere (Dion2's
  globally selected rows); a reduce-scatter along the batch adds the parts (exactly:
  every row is nonzero on one device) and an all-to-all over ``names_l`` assembles the
  columns: (B, k, l/N_l) -> (ceil(B/N), k, l). The sum runs on the bit patterns too:
  adding +0.0's all-zero patterns to one value's is exact in integers.
  """
  x = _bits(_padded_to_group(x_bxkxl, axis_size(names_sum) * axis_size(names_l)))
  if names_sum:
    x = jax.lax.psum_scatter(x, names_sum, scatter_dimension=0, tiled=True)
  if names_l:
    x = jax.lax.all_to_all(x, names_l, 0, 2, tiled=True)
  return _unbits(x, x_bxkxl.dtype)


def broadcast_from_owner(y: jax.Array, names_sum: Names, names_l: Names, batch: int) -> jax.Array:
  """Inverse direction of :func:`reduce_to_owner`: every device of ``names_sum`` gets
  every matrix's (k x l/N_l) block, (batch, k, l/N_l), and keeps the rows it owns."""
  dtype, y = y.dtype, _bits(y)
  if names_l:
    y = jax.lax.all_to_all(y, names_l, 2, 0, tiled=True)
  if names_sum:
    y = jax.lax.all_gather(y, names_sum, axis=0, tiled=True)
  return _unbits(y[:batch], dtype)
