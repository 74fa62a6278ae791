"""Counter-based random sketch matrices for randomized Cholesky QR.

RCQR multiplies the tall matrix ``P`` (m x r) by a random sketch ``S`` (k x m)
with i.i.d. zero-mean entries of variance 1/k. Instead of drawing and storing
``S``, every entry is a pure function of ``(seed, global row j, sketch row i)``:

    h = hash(seed, j, i)                          (32 bits)
    S[i, j] = (b₀ + b₁ + b₂ + b₃ − 510) / sqrt(21845 k)    (bᵢ the four bytes of h)

The sum of four uniform bytes (Irwin–Hall) is close to Gaussian (same mean and
variance, bounded tails) and, like any i.i.d. sub-Gaussian sketch, gives RCQR the
subspace embedding it needs. The reference draws N(0, 1/k); Box–Muller needs a log,
a square root and a cosine per entry, which made generating S cost as much as all
of Dion's matmuls at rank 1/4 on a CPU.

so that
- every rp replica that uses the same seed builds the same ``S``;
- a tp shard holding rows ``[j0, j0 + m_local)`` of ``P`` builds exactly its own
  column block of the global ``S``, whatever the number of shards;
- a GPU kernel can generate ``S`` tile by tile in registers (``dion_jax.kernels.rcqr``
  calls :func:`sketch_entries` inside the kernel), never touching memory.

The hash is murmur3's 32-bit finalizer, applied once per row and once per entry;
it only uses uint32 multiply, xor and shifts, so it lowers everywhere (XLA on
CPU/GPU, Triton).
"""

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(0x9E3779B9)


def _fmix32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def mix_seed(*words) -> jax.Array:
  """Hashes integers (Python ints or uint32 arrays, broadcast) into one uint32 seed."""
  h = jnp.uint32(0x243F6A88)
  for w in words:
    h = _fmix32(h ^ (jnp.asarray(w).astype(jnp.uint32) * _GOLDEN))
  return h


_BYTE_SUM_MEAN = 510.0  # 4 · 255 / 2
_BYTE_SUM_STD = float(np.sqrt(4 * (256**2 - 1) / 12))


def sketch_entries(seed: jax.Array, row: jax.Array, col: jax.Array, scale: float = 1.0) -> jax.Array:
  """Zero-mean, near-Gaussian float32 samples of std ``scale``, one per (seed, row, col), broadcast."""
  h = _fmix32(_fmix32(seed.astype(jnp.uint32) ^ row.astype(jnp.uint32)) ^ (col.astype(jnp.uint32) * _GOLDEN))
  byte_sum = (h & 0xFF) + ((h >> 8) & 0xFF) + ((h >> 16) & 0xFF) + (h >> 24)
  # One multiply by a constant: jit and eager round the same way.
  return (byte_sum.astype(jnp.float32) - np.float32(_BYTE_SUM_MEAN)) * np.float32(scale / _BYTE_SUM_STD)


def sketch_size(r: int, oversample: float) -> int:
  """Rows k of the sketch: ``ceil(oversample * r / 128) * 128``, as the reference."""
  return int(np.ceil(oversample * r / 128.0)) * 128


def sketch_block(seed: jax.Array, row_start: jax.Array, rows: int, k: int) -> jax.Array:
  """Columns ``[row_start, row_start + rows)`` of the global sketch S, shape (k, rows), float32."""
  j = row_start + jnp.arange(rows, dtype=jnp.uint32)[None, :]
  i = jnp.arange(k, dtype=jnp.uint32)[:, None]
  return sketch_entries(seed, j, i, scale=1.0 / np.sqrt(k))
