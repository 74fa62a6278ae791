"""What every Pallas kernel of ``dion_jax.kernels`` shares: backend, precision, tiles,
batching, and the mesh typing of their outputs.

Backend: Triton (``jax.experimental.pallas.triton``). It runs on Ampere and
Hopper, lowers on a CPU-only machine (the tests parse each kernel's Triton module
as the GPU compiler does), and its tile model fits these small-tile streaming
matmuls. Mosaic GPU would only run on Hopper and newer. Triton lowering is
deprecated upstream from jax 0.11: moving to Mosaic GPU means rewriting the kernel
bodies of this folder. Only the Pallas modules of this folder import Pallas, and
they are imported only by ``dion_jax.kernels.backend``, when a call asks for them.

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

import jax
import jax.numpy as jnp
from jax import custom_batching, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Tile sizes. Triton tiles are powers of two; rows of P are masked, r is padded.
BM = 32  # rows of P per inner step (the contraction of the sketch and the Gram)
BK_SKETCH = 64  # sketch rows per program
BN_SKETCH = 128  # columns of P per sketch program (S is regenerated per r-tile)
BM_SOLVE, BN_SOLVE, BK_SOLVE = 64, 64, 32
BN_GRAM = 64
FUSED_MAX_R = 128  # largest padded r whose r x r Gram fits in registers
TARGET_PROGRAMS = 264  # two waves on an H100's 132 SMs: fixes the row-chunk counts
NUM_WARPS = 4


def use_interpret(interpret: bool | None) -> bool:
  return jax.default_backend() != "gpu" if interpret is None else interpret


def matmul_precision(interpret: bool):
  # TF32x3 keeps float32 accuracy on tensor cores; the CPU interpreter only has IEEE float32.
  if interpret:
    return lax.DotAlgorithmPreset.F32_F32_F32
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def tile_dot(a, b, precision, contract_a: int = 1):
  return lax.dot_general(
      a, b, (((contract_a,), (0,)), ((), ())), precision=precision,
      preferred_element_type=jnp.float32)


def upper_tile_steps(upper: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
  """Bounds of a ``fori_loop`` that runs ``steps`` times on an upper tile, never below.

  Both bounds are int32 arrays: Triton's ``scf.for`` needs its bounds of one type, and
  on jax 0.11 a Python ``0`` beside a traced ``jnp.where`` lowered as two types, which
  the GPU compiler rejected (the CPU lowering and the interpreter accept it).
  """
  return jnp.int32(0), jnp.where(upper, jnp.int32(steps), jnp.int32(0))


def round_up(x: int, n: int) -> int:
  return -(-x // n) * n


def padded_rank(r: int) -> int:
  """r padded to a power of two ≥ 16 when the fused path takes it, else to the tile width."""
  if r <= FUSED_MAX_R:
    return max(16, pl.next_power_of_2(r))
  return round_up(r, BN_SOLVE)


def row_chunks(num_blocks: int, tiles: int, cap: int) -> tuple[int, int]:
  """(chunks, row blocks per chunk) splitting ``num_blocks`` for about TARGET_PROGRAMS programs."""
  want = max(1, min(num_blocks, cap, -(-TARGET_PROGRAMS // tiles)))
  steps = -(-num_blocks // want)
  return -(-num_blocks // steps), steps


def partial_cap(m: int, rows_out: int) -> int:
  """Most row chunks whose float32 partial sums (rows_out x r each) stay within 1/4 of P's float32 bytes."""
  return max(1, m // (4 * rows_out))


def varying_alike(*inputs):
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


def f32_out(shape, mat) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=mat)


def compiler_params(num_warps: int = NUM_WARPS):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


# --- Batching: kernels take a leading batch axis; vmaps fold into it ----------------


def stacked_kernel(core):
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
