"""The gradient norm that clipping and the log see, where Dion's replicas keep their own
gradients (``train/run/step.py``; docs/design.md §3).

With Dion's compressed sync (rp > 1) its matrices' gradients carry a leading rp axis, one
gradient g_r per replica, and the gradient Dion applies is their mean ḡ, which no device
holds: the replicas exchange only Dion's low-rank factors. The other leaves are averaged
over rp already and enter every norm exactly. Of the per-replica leaves (``--grad-norm``):

- ``sketch`` (the default) estimates ‖ḡ‖ from a k-number sketch of each replica's
  gradient, k = ``sketch_size`` (4 kB at 1024), all-reduced over rp:

      ‖ḡ‖² = (1/rp²)·[Σ_r ‖g_r‖² + Σ_{r≠s} ⟨g_r, g_s⟩]
           ≈ (1/rp²)·[Σ_r ‖g_r‖² + ‖Σ_r S g_r‖² − Σ_r ‖S g_r‖²]

  The replicas' own squared norms (the diagonal) are exact; only the cross terms come from
  the sketch. S is a count sketch: entry i of a matrix (its rows and columns the last two
  axes, earlier axes stacked) goes with a sign s_i = ±1 into bucket (row mod k_r, column
  mod k_c), k_r·k_c = k (32 x 32 at 1024; fewer where a side has fewer powers of two),
  every leaf into the same k buckets. As the signs are independent of the gradients,
  E[⟨Sx, Sy⟩] = ⟨x, y⟩ whatever the buckets, so the estimate of ‖ḡ‖² is unbiased. Its
  variance, with A = Σ_{r≠s} g_r g_sᵀ, is exactly

      Var = (2/rp⁴)·Σ_b Σ_{i≠j in bucket b} A_ij²,

  about (2/k)·Σ_{i≠j} A_ij²/rp⁴ for gradients with no structure along the buckets. For
  replicas that see a common mean plus independent noise, its relative spread (standard
  deviation over ‖ḡ‖²) lies between (1 − 1/rp)·√(2/k) (all mean) and √((1 − 1/rp)·2/k)
  (all noise): at most 4.1% of ‖ḡ‖² at k = 1024 and rp = 8, about 2.1% of the norm.
  Taking the whole ‖S ḡ‖² instead would spread by √(2/k) and need no clamp; the exact
  diagonal removes the replicas' own collisions, which pays most at small rp (rp = 2:
  a half). The estimate can come out below zero only if the cross terms' error exceeds
  the diagonal, many standard deviations away; it is then clamped to zero, which can
  only raise the norm (clipping errs on the safe side).

  The signs come from a hash of the step, the leaf and the entry's global index
  (murmur3's 32-bit finalizer of the row's hash and the column: two multiplies and
  three shifts per entry; jax.random's threefry took 16x as long on CPU for the same
  signs), and the buckets from the global row and column, so every mesh sketches the
  same numbers, every replica agrees, and a run repeats bit for bit. Each device
  sketches its own block of each leaf inside a ``shard_map`` (a reshape and a sum: a
  block whose sides are multiples of k_r and k_c holds whole buckets, as every shard of
  a side multiple of 32 does at 1024; another block is first copied among zeros); the
  blocks' sketches add up over the leaves, then in one all-reduce of k numbers over the
  other mesh axes, and the replicas' in one of k + 1 over rp. Per entry and replica:
  an xor, the hash, a sign and an add (about 10 integer and floating-point
  operations), beside the squares all three norms take.
- ``rms``: the root mean square over replicas of each replica's own norm, ‖ḡ‖² ≤
  (1/rp)·Σ_r ‖g_r‖² (one scalar all-reduce): an upper bound, loose by the replicas'
  spread, about rp times the whole batch's gradient noise; clipping to it fires
  earlier than one device would.
- ``exact``: ‖ḡ‖ itself, at the cost of averaging every per-replica gradient over rp (an
  all-reduce as large as AdamW's gradient sync; Megatron-Dion's choice).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from dion_jax.parallel import REPLICA_AXIS, axis_names

# The norms of per-replica gradients (module docstring); the first is the default.
NORMS = ("sketch", "rms", "exact")
# Numbers each replica's sketch holds: 4 kB of float32, 0.26% of Dion's bytes over rp on
# tiny at rp=8, rank 1/4 (docs/design.md §3, where it was chosen).
SKETCH_SIZE = 1024
# The log line's name of each norm (config.json's ``"grad_norm"`` holds the key).
LOG_NAMES = {"exact": "grad norm", "sketch": "grad norm (sketch estimate)", "rms": "grad norm (rms over replicas)"}


def shown(grad_norm: str, per_replica: Any | None) -> str:
  """The norm a run logs and clips by: ``grad_norm`` where some leaves are per replica,
  else the exact norm (no replicas, or none of Dion's)."""
  return grad_norm if per_replica is not None else "exact"


def global_norm(grads: Any, per_replica: Any | None, grad_norm: str = NORMS[0], sketch_size: int = SKETCH_SIZE,
                step: jax.Array | int = 0, mesh: jax.sharding.Mesh | None = None, specs: Any | None = None
                ) -> jax.Array:
  """The float32 global norm of ``grads`` (module docstring), those leaves ``per_replica``
  marks [rp, ...] (one gradient per replica, matrices); ``step`` seeds the sketch's signs.
  On a ``mesh``, ``specs`` are the leaves' PartitionSpecs without the rp axis."""
  if per_replica is None:
    return optax.tree.norm(grads)
  if grad_norm not in NORMS:
    raise ValueError(f"grad_norm {grad_norm!r}: choose one of {', '.join(NORMS)}")
  flags = jax.tree.leaves(per_replica)
  leaves = jax.tree.leaves(grads)
  replicas = [g for g, rep in zip(leaves, flags) if rep]
  averaged = optax.tree.norm([g for g, rep in zip(leaves, flags) if not rep], squared=True)
  if not replicas:
    return jnp.sqrt(averaged)
  if grad_norm == "exact":
    return jnp.sqrt(averaged + optax.tree.norm([g.mean(0) for g in replicas], squared=True))
  rp = replicas[0].shape[0]
  diagonal = optax.tree.norm(replicas, squared=True)  # Σ_r ‖g_r‖²
  if grad_norm == "rms":
    return jnp.sqrt(averaged + diagonal / rp)
  if mesh is None:
    cross = _cross_terms(replicas, [P()] * len(replicas), sketch_size, step, {})
  else:
    spec_of = [s for s, rep in zip(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), flags) if rep]
    sizes = dict(mesh.shape)
    cross = jax.shard_map(lambda step, *gs: _cross_terms(gs, spec_of, sketch_size, step, sizes), mesh=mesh,
                          in_specs=(P(), *(P(REPLICA_AXIS, *s) for s in spec_of)), out_specs=P())(
                              jnp.asarray(step), *replicas)
  return jnp.sqrt(averaged + jnp.maximum(diagonal + cross, 0.0) / rp**2)


def _cross_terms(replicas: list[jax.Array], specs: list[P], sketch_size: int, step: jax.Array,
                 sizes: dict[str, int]) -> jax.Array:
  """‖Σ_r S g_r‖² − Σ_r ‖S g_r‖², the estimate of Σ_{r≠s} ⟨g_r, g_s⟩. On a mesh (``sizes``,
  inside a shard_map manual over every axis) each device sketches its block of each
  leaf; the blocks' sketches add up over the axes that shard the leaf (a copy on the
  others counted once), one all-reduce of ``sketch_size`` numbers per replica, then one
  of ``sketch_size`` + 1 over rp (the sketches and their squared norms)."""
  partial_RxK = 0
  for leaf, (g, spec) in enumerate(zip(replicas, specs)):
    offsets, full, owner = _block(g.shape[1:], spec, sizes)
    partial_RxK += jnp.where(owner, sketch(g, sketch_size, _seed(step, leaf), offsets, full), 0.0)
  others = tuple(a for a in sizes if a != REPLICA_AXIS)
  if others:  # axes of size 1 vary nowhere: cast so that the sum may name them
    varying = jax.typeof(partial_RxK).manual_axis_type.varying
    partial_RxK = jax.lax.pcast(partial_RxK, tuple(a for a in others if a not in varying), to="varying")
  own_RxK = jax.lax.psum(partial_RxK, others) if others else partial_RxK
  squares = jnp.sum(own_RxK**2, axis=-1, keepdims=True)
  summed = jnp.concatenate([own_RxK, squares], axis=-1).sum(0)  # Σ_r over the local replicas
  if REPLICA_AXIS in sizes:
    summed = jax.lax.psum(summed, REPLICA_AXIS)
  return jnp.sum(summed[:-1] ** 2) - summed[-1]


def _block(shape: tuple[int, ...], spec: P, sizes: dict[str, int]
           ) -> tuple[tuple[jax.Array, ...], tuple[int, ...], jax.Array]:
  """This device's block, of ``shape``, of a leaf laid out by ``spec``: the global index of
  its first entry along each axis, the leaf's shape, and whether the device owns the
  block (the first copy along the mesh axes that do not shard the leaf)."""
  offsets, full, used = [], [], set()
  for d, size in enumerate(shape):
    axes = [a for a in axis_names(spec[d] if d < len(spec) else None) if sizes.get(a, 1) > 1]
    used |= set(axes)
    index = jnp.zeros((), jnp.int32)
    for a in axes:  # major to minor, as a PartitionSpec's tuple
      index = index * sizes[a] + jax.lax.axis_index(a)
    offsets.append((index * size).astype(jnp.uint32))
    full.append(size * math.prod(sizes[a] for a in axes))
  copies = [jax.lax.axis_index(a) == 0 for a in sizes if a != REPLICA_AXIS and sizes[a] > 1 and a not in used]
  return tuple(offsets), tuple(full), jnp.all(jnp.asarray(copies)) if copies else jnp.asarray(True)


def buckets(rows: int, cols: int, sketch_size: int) -> tuple[int, int]:
  """(k_r, k_c): the buckets along the rows and the columns of a ``rows`` x ``cols`` matrix:
  powers of two dividing its sides, k_r·k_c = ``sketch_size`` where the sides allow
  (32 x 32 at 1024)."""
  k_rows = math.gcd(rows, 2 ** (int(math.log2(sketch_size)) // 2))
  return k_rows, math.gcd(cols, sketch_size // k_rows)


def signs(shape: tuple[int, ...], seed: jax.Array, offsets: tuple[jax.Array, ...] | None = None,
          full: tuple[int, ...] | None = None) -> jax.Array:
  """bool ``shape``: whether each entry's sign is +1, from the hash of ``seed`` (uint32) and
  its global index (the leading axes and the rows as one index, then the column) in a
  leaf of shape ``full`` (default ``shape``), the block starting at ``offsets``."""
  full = full or shape
  offsets = offsets or (jnp.uint32(0),) * len(shape)
  rows_shape = (*shape[:-1], 1)
  row_ids = jnp.zeros(rows_shape, jnp.uint32)
  for d in range(len(shape) - 1):
    stride = jnp.uint32(math.prod(full[d + 1:-1]))
    row_ids += (jax.lax.broadcasted_iota(jnp.uint32, rows_shape, d) + offsets[d]) * stride
  col_ids = jax.lax.broadcasted_iota(jnp.uint32, (1,) * (len(shape) - 1) + shape[-1:], len(shape) - 1) + offsets[-1]
  return (_fmix32(_fmix32(seed ^ row_ids) ^ (col_ids * jnp.uint32(0x9E3779B9))) >> 31).astype(bool)


def sketch(g: jax.Array, sketch_size: int, seed: jax.Array, offsets: tuple[jax.Array, ...] | None = None,
           full: tuple[int, ...] | None = None) -> jax.Array:
  """float32 [R, sketch_size]: the count sketch (module docstring) of each of the R
  matrices of ``g`` [R, ..., rows, cols], a block at ``offsets`` of a leaf of shape
  ``full`` (default ``g``'s without R); buckets past the leaf's k_r·k_c stay zero."""
  if g.ndim < 3:
    raise ValueError(f"a per-replica gradient of shape {g.shape}: expected [rp, ..., rows, cols]")
  full = full or g.shape[1:]
  offsets = offsets or (jnp.uint32(0),) * (g.ndim - 1)
  k_rows, k_cols = buckets(*full[-2:], sketch_size)
  signed = jnp.where(signs(g.shape[1:], seed, offsets, full), g, -g).astype(jnp.float32)
  signed = _aligned(_aligned(signed, -2, k_rows, offsets[-2]), -1, k_cols, offsets[-1])
  R, *lead, rows, cols = signed.shape
  grouped = signed.reshape(R, *lead, rows // k_rows, k_rows, cols // k_cols, k_cols)
  summed = (*range(1, len(lead) + 1), len(lead) + 1, len(lead) + 3)
  sketched_RxK = grouped.sum(summed).reshape(R, k_rows * k_cols)
  return jnp.pad(sketched_RxK, ((0, 0), (0, sketch_size - k_rows * k_cols)))


def _aligned(x: jax.Array, axis: int, k: int, offset: jax.Array) -> jax.Array:
  """``x``, a block starting at global index ``offset`` along ``axis``, placed among zeros
  so that its entry j falls at (offset + j) mod k of whole groups of k: as is where k
  divides the block (and so its offset); a copy of the block where a mesh cuts the
  leaf's groups (a side per shard not a multiple of 32 at 1024)."""
  n = x.shape[axis]
  if n % k == 0:
    return x
  shape = list(x.shape)
  shape[axis] = -(-(n + k - 1) // k) * k
  start = [jnp.zeros((), jnp.int32)] * x.ndim
  start[axis] = (offset % k).astype(jnp.int32)
  return jax.lax.dynamic_update_slice(jnp.zeros(shape, x.dtype), x, start)


def _seed(step: jax.Array | int, leaf: int) -> jax.Array:
  """uint32: the hash of the step and the leaf's number among the per-replica leaves."""
  return _fmix32(_fmix32(jnp.asarray(step).astype(jnp.uint32)) ^ jnp.uint32(leaf * 0x85EBCA6B % 2**32))


def _fmix32(x: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer: a bijection of uint32 whose every input bit flips each
  output bit with probability about 1/2."""
  x ^= x >> 16
  x *= jnp.uint32(0x85EBCA6B)
  x ^= x >> 13
  x *= jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)
