"""Counter-based Gaussian sketch matrices for randomized Cholesky QR.

RCQR multiplies the tall matrix ``P`` (m x r) by a random sketch ``S`` (k x m)
with entries N(0, 1/k). Instead of drawing and storing ``S``, every entry is a
pure function of ``(seed, global row j, sketch row i)``:

    S[i, j] = BoxMuller(hash(seed, j, i)) / sqrt(k)

so that
- every rp replica that uses the same seed builds the same ``S``;
- a tp shard holding rows ``[j0, j0 + m_local)`` of ``P`` builds exactly its own
  column block of the global ``S``, whatever the number of shards;
- a GPU kernel can generate ``S`` tile by tile in registers (``dion_jax.pallas_rcqr``
  calls :func:`gaussian_from_counter` inside the kernel), never touching memory.

The hash is murmur3's 32-bit finalizer applied three times, which is plenty for a
subspace embedding; it only uses uint32 multiply, xor and shifts, so it lowers
everywhere (XLA on CPU/GPU, Triton).
"""

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(0x9E3779B9)
_SECOND = np.uint32(0x5BD1E995)


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


def gaussian_from_counter(seed: jax.Array, row: jax.Array, col: jax.Array) -> jax.Array:
  """Standard normal float32 samples, one per broadcast (seed, row, col) triple."""
  seed = seed.astype(jnp.uint32)
  h1 = _fmix32(_fmix32(seed ^ row.astype(jnp.uint32)) ^ (col.astype(jnp.uint32) * _GOLDEN))
  h2 = _fmix32(h1 ^ _SECOND)
  # 24-bit uniforms; u1 in (0, 1] keeps the log finite.
  u1 = ((h1 >> 8).astype(jnp.float32) + 1.0) * np.float32(2.0**-24)
  u2 = (h2 >> 8).astype(jnp.float32) * np.float32(2.0**-24)
  return jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(np.float32(2.0 * np.pi) * u2)


def sketch_size(r: int, oversample: float) -> int:
  """Rows k of the sketch: ``ceil(oversample * r / 128) * 128``, as the reference."""
  return int(np.ceil(oversample * r / 128.0)) * 128


def sketch_block(seed: jax.Array, row_start: jax.Array, rows: int, k: int) -> jax.Array:
  """Columns ``[row_start, row_start + rows)`` of the global sketch S, shape (k, rows), float32."""
  j = row_start + jnp.arange(rows, dtype=jnp.uint32)[None, :]
  i = jnp.arange(k, dtype=jnp.uint32)[:, None]
  return gaussian_from_counter(seed, j, i) * np.float32(1.0 / np.sqrt(k))
