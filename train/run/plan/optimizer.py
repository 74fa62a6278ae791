"""What one optimizer update moves and holds per device, on paper (``python -m train.plan``).

Every matrix optimizer steps the parameters of one geometry (shape and PartitionSpec) as
one stacked megabatch (``dion_jax.optimizers.skeleton``). Per Dion megabatch (b local
matrices: the stacked parameters times each one's local batch, rows over the row axes R,
here always tp, columns over the column axes C, here cp·fs·ep; r the rank; compressed
sync adds rp, ``dion_jax.optimizers.dion``):

    P = B Q     (b, rows/R, r) float32 summed over C (+rp): a reduce-scatter over C, the
                mean over rp of each device's 1/C part, an all-gather over C; or, when b
                divides C·rp, reduce-scatters along the batch over C, then rp, and
                all-gathers back
    orthonormalize P (RCQR, ``dion_jax.linalg.qr``): per matrix a (k, r) sketch and an
                (r, r) Gram summed over R, k = ceil(1.25·r/128)·128; Householder (an
                all-gather of P over R) when rows <= r
    R = Bᵀ P    (b, cols/C, r) float32 summed over R (+rp), as P: the replicas average
                a 1/R part
    ‖R‖_col     (b, 1, r) summed over C;  an int32 (b,) guard (all zero, not finite) over
                R, C (+rp)

With ``split_q`` (``--dion-split-q``) Q's r is split over R where R > 1 divides it: Q
(b, cols/C, r) is all-gathered over R before B Q (its float32 bytes, the whole Q), and
each device keeps its r/R columns of the new one.

Without compression on rp > 1 the matrix's gradient is averaged over rp first.

Muon and NorMuon (``dion_jax.parallel.megabatch``): each megabatch, padded to a multiple
of the N devices sharing a matrix and cast to bfloat16, goes whole to one device by an
all-to-all over each sharded matrix axis, and back: four all-to-alls of the block.
NorMuon adds its per-neuron sums over fan_in and two Frobenius norms. Dion2/NorDion2 move
their slices' L1 norms and only the selected slices (``_selected``).
AdamW (and the scalar optimizer of the others) is elementwise on shards: no collective.

State per device: AdamW two float32 copies of the parameter; Dion the momentum and Q
(b, cols/C, r), or (b, cols/C, r/R) split; Muon and Dion2 the momentum; NorMuon and
NorDion2 also a second moment per output neuron.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from dion_jax.kernels.sketch import sketch_size
from dion_jax.optimizers.frame import DionDimensionNumbers, matrix_frame
from train.run.plan.model import Collective, Leaf, group, live, local_bytes, local_shape

OPTIMIZERS = ("dion", "dion2", "nordion2", "muon", "normuon", "adamw")


def _q_split(leaf: Leaf, sizes: dict[str, int], rank_fraction: float, split_q: bool) -> int:
  """The devices Q's r is split over: with ``split_q`` the row group, where it is more than
  one device and divides r (``dion_jax.optimizers.dion``); else 1."""
  fr = matrix_frame(leaf.shape, DionDimensionNumbers(), rank_fraction, 1, leaf.spec, leaf.name)
  rows = group(sizes, live(sizes, [leaf.spec[fr.row_axis]]))
  return rows if split_q and fr.rank % rows == 0 else 1


def _q_bytes(leaf: Leaf, sizes: dict[str, int], rank_fraction: float, stacked: int) -> int:
  """One megabatch's whole Q on a device, (b, cols/C, r) float32."""
  fr = matrix_frame(leaf.shape, DionDimensionNumbers(), rank_fraction, 1, leaf.spec, leaf.name)
  shape = local_shape(leaf, sizes)
  return stacked * math.prod(shape[a] for a in fr.batch_axes) * shape[fr.col_axis] * fr.rank * 4


def _dion(leaf: Leaf, sizes: dict[str, int], rank_fraction: float, per_replica: bool, stacked: int,
          split_q: bool = False):
  """One megabatch: ``stacked`` parameters of ``leaf``'s geometry."""
  fr = matrix_frame(leaf.shape, DionDimensionNumbers(), rank_fraction, 1, leaf.spec, leaf.name)
  rows_ax, cols_ax = live(sizes, [leaf.spec[fr.row_axis]]), live(sizes, [leaf.spec[fr.col_axis]])
  shape = local_shape(leaf, sizes)
  b = stacked * math.prod(shape[a] for a in fr.batch_axes)
  rows, r = shape[fr.row_axis], fr.rank
  q_bytes, q_split = _q_bytes(leaf, sizes, rank_fraction, stacked), _q_split(leaf, sizes, rank_fraction, split_q)
  compressed = per_replica and sizes["rp"] > 1 and fr.compressible
  replica = ("rp",) if compressed else ()
  out = []

  def add(purpose, op, axes, nbytes):
    axes = live(sizes, axes)
    if axes and nbytes:
      out.append(Collective(purpose, op, axes, int(nbytes), 1))

  def mean_of_sum(purpose, total, mean, nbytes):
    """``collectives.sum_then_mean``: the mean over ``mean`` of a 1/|total| part of the sum."""
    total, mean = live(sizes, total), live(sizes, mean)
    if total and mean and (nbytes // 4) % group(sizes, total) == 0:
      add(purpose, "reduce-scatter", total, nbytes)
      add(purpose, "all-reduce", mean, nbytes // group(sizes, total))
      add(purpose, "all-gather", total, nbytes)
    else:
      add(purpose, "all-reduce", total + mean, nbytes)

  if per_replica and sizes["rp"] > 1 and not compressed:
    add("replica gradient mean", "all-reduce", ["rp"], stacked * local_bytes(leaf, sizes))
  if q_split > 1:
    add("dion Q", "all-gather", rows_ax, q_bytes)
  p_group = live(sizes, cols_ax + replica)
  p_bytes = b * rows * r * 4
  spread = p_group and b % group(sizes, p_group) == 0
  if spread:  # the batch split over the columns' group, then the replicas
    over_replicas = p_bytes // group(sizes, live(sizes, cols_ax))
    add("dion P", "reduce-scatter", cols_ax, p_bytes)
    add("dion P", "reduce-scatter", replica, over_replicas)
    add("dion P", "all-gather", replica, over_replicas)
    add("dion P", "all-gather", cols_ax, p_bytes)
  else:
    mean_of_sum("dion P", cols_ax, replica, p_bytes)
  matrices = b // group(sizes, p_group) if spread else b
  if fr.rows <= r:
    add("dion orthonormalization", "all-gather", rows_ax, matrices * fr.rows * r * 4)
  else:
    add("dion orthonormalization", "all-reduce", rows_ax, matrices * (sketch_size(r, 1.25) + r) * r * 4)
  mean_of_sum("dion R", rows_ax, replica, q_bytes)
  add("dion column norms", "all-reduce", cols_ax, b * r * 4)
  add("dion column norms", "all-reduce", rows_ax + cols_ax + replica, b * 4)  # the guard
  state = stacked * local_bytes(leaf, sizes) + q_bytes // q_split
  return out, state


def _orthogonal(leaf: Leaf, sizes: dict[str, int], optimizer: str, stacked: int):
  """One megabatch of Muon or NorMuon: ``stacked`` parameters of ``leaf``'s geometry."""
  shape = local_shape(leaf, sizes)
  fan_in_ax, fan_out_ax = live(sizes, [leaf.spec[-2]]), live(sizes, [leaf.spec[-1]])
  b = stacked * math.prod(shape[:-2])
  n = group(sizes, fan_in_ax + fan_out_ax)
  block = int(math.ceil(b / n) * n * shape[-2] * shape[-1] * 2)  # bfloat16
  out = [Collective("orthogonal all-to-all", "all-to-all", axes, 2 * block, 2)
         for axes in (fan_in_ax, fan_out_ax) if axes]
  return out + _normuon_norms(sizes, optimizer, fan_in_ax, fan_out_ax, b, shape), _state(leaf, sizes, optimizer, stacked)


def _selected(leaf: Leaf, sizes: dict[str, int], optimizer: str, fraction: float, scope: str, stacked: int):
  """One megabatch of Dion2 or NorDion2 (``orthogonal_math.dion2_step``): the slices' L1
  norms summed over the other side; with ``scope`` "global" (the trainer's) the norms
  gathered over the selection's side, the exact top ceil(fraction·s) slices each summed
  (reduce-scattered) onto one device per matrix, and their polar factors gathered back;
  with "local" each shard's own top slices travel like Muon's blocks."""
  shape = local_shape(leaf, sizes)
  fan_in_ax, fan_out_ax = live(sizes, [leaf.spec[-2]]), live(sizes, [leaf.spec[-1]])
  b = stacked * math.prod(shape[:-2])
  select_in = optimizer == "dion2" and leaf.shape[-1] > leaf.shape[-2]  # the shorter side; NorDion2: neurons
  s_ax, l_ax = (fan_in_ax, fan_out_ax) if select_in else (fan_out_ax, fan_in_ax)
  s_local, l_local = (shape[-2], shape[-1]) if select_in else (shape[-1], shape[-2])
  n = group(sizes, s_ax + l_ax)
  padded = math.ceil(b / n) * n
  out = [Collective("dion2 selection", "all-reduce", l_ax, b * s_local * 4, 1)] if l_ax else []
  if scope == "global" or not s_ax:
    k = max(1, math.ceil(fraction * s_local * group(sizes, s_ax)))
    rows = padded * k * l_local * 2  # bfloat16
    if s_ax:
      out += [Collective("dion2 selection", "all-gather", s_ax, b * s_local * group(sizes, s_ax) * 4, 1),
              Collective("orthogonal all-to-all", "reduce-scatter", s_ax, rows, 1),
              Collective("orthogonal all-to-all", "all-gather", s_ax, rows, 1)]
    if l_ax:
      out.append(Collective("orthogonal all-to-all", "all-to-all", l_ax, 2 * rows // group(sizes, s_ax), 2))
  else:
    rows = padded * max(1, math.ceil(fraction * s_local)) * l_local * 2
    out += [Collective("orthogonal all-to-all", "all-to-all", axes, 2 * rows, 2) for axes in (s_ax, l_ax) if axes]
  return out + _normuon_norms(sizes, optimizer, fan_in_ax, fan_out_ax, b, shape), _state(leaf, sizes, optimizer, stacked)


def _normuon_norms(sizes: dict[str, int], optimizer: str, fan_in_ax, fan_out_ax, b: int, shape) -> list[Collective]:
  """NorMuon's per-neuron sums of squares over fan_in, and the Frobenius norms of U
  before and after its normalization."""
  if optimizer not in ("normuon", "nordion2"):
    return []
  out = [Collective("normuon norms", "all-reduce", fan_in_ax, b * shape[-1] * 4, 1)] if fan_in_ax else []
  if fan_in_ax + fan_out_ax:
    out.append(Collective("normuon norms", "all-reduce", live(sizes, fan_in_ax + fan_out_ax), 2 * b * 4, 2))
  return out


def _state(leaf: Leaf, sizes: dict[str, int], optimizer: str, stacked: int) -> int:
  """The momentum, and NorMuon's and NorDion2's second moment per output neuron."""
  state = stacked * local_bytes(leaf, sizes)
  if optimizer in ("normuon", "nordion2"):
    state += stacked * local_bytes(leaf, sizes) // local_shape(leaf, sizes)[-2]
  return state


def update(params: Sequence[Leaf], sizes: dict[str, int], optimizer: str, rank_fraction: float = 0.25,
           fraction: float = 0.25, per_replica: bool = True, selection_scope: str = "global",
           split_q: bool = False, megabatch_bytes: int | None = None) -> tuple[list[Collective], int]:
  """``(collectives, optimizer-state bytes)`` of one update, per device.

  ``rank_fraction`` and ``split_q`` are Dion's; ``fraction`` and ``selection_scope`` Dion2's
  and NorDion2's (the trainer's: "global"); ``per_replica``: Dion's compressed sync over rp
  (``replicate_sync``, the default of ``dion_jax.dion``); ``megabatch_bytes`` the chunks'
  bound (:func:`chunks`: each chunk its own collectives, the same bytes in all).
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"--optimizer {optimizer}: choose one of {', '.join(OPTIMIZERS)}")
  collectives = []
  state = sum(2 * local_bytes(leaf, sizes) for leaf in params if optimizer == "adamw" or leaf.label != "dion")
  for same in chunks(params, sizes, optimizer, rank_fraction, split_q, megabatch_bytes):
    if optimizer == "dion":
      c, s = _dion(same[0], sizes, rank_fraction, per_replica, len(same), split_q)
    elif optimizer in ("dion2", "nordion2"):
      c, s = _selected(same[0], sizes, optimizer, fraction, selection_scope, len(same))
    else:
      c, s = _orthogonal(same[0], sizes, optimizer, len(same))
    collectives += c
    state += s
  return collectives, state


def flops(params: Sequence[Leaf], sizes: dict[str, int], optimizer: str, rank_fraction: float = 0.25,
          fraction: float = 0.25) -> float:
  """Matrix-multiply flops of one update on one device (elementwise work left out).

  Dion: B Q, Bᵀ P, the error feedback P Rᵀ and the update P Qᵀ, 2·m·n·r each on the local
  block. Muon: five quintic Newton-Schulz steps on whole matrices (each device holds
  1/N of them): per step X Xᵀ (2·s²·l), its square (2·s³) and the product with X (2·s²·l),
  s the short side. Dion2/NorDion2: the same on the selected fraction.
  """
  total = 0.0
  for leaf in params:
    if optimizer == "adamw" or leaf.label != "dion":
      continue
    shape = local_shape(leaf, sizes)
    if optimizer == "dion":
      fr = matrix_frame(leaf.shape, DionDimensionNumbers(), rank_fraction, 1, leaf.spec, leaf.name)
      total += 8 * math.prod(shape) * fr.rank
      continue
    s, l = sorted(leaf.shape[-2:])
    group_ = group(sizes, live(sizes, [leaf.spec[-2], leaf.spec[-1]]))
    matrices = math.ceil(math.prod(shape[:-2]) / group_)  # whole matrices on this device
    selected = fraction if optimizer in ("dion2", "nordion2") else 1.0
    total += selected * matrices * 5 * (4 * s * s * l + 2 * s**3)
  return total


def _megabatches(params: Sequence[Leaf], optimizer: str) -> list[list[Leaf]]:
  """The matrices the update stacks together: one list per (global shape, spec)."""
  same: dict[tuple, list[Leaf]] = {}
  for leaf in params:
    if optimizer != "adamw" and leaf.label == "dion":
      same.setdefault((leaf.shape, leaf.spec), []).append(leaf)
  return list(same.values())


def _leaf_bytes(leaf: Leaf, sizes: dict[str, int], optimizer: str, rank_fraction: float, split_q: bool) -> int:
  """One parameter's gradient and optimizer state per device: what a megabatch stacks of it."""
  if optimizer == "dion":
    q = _q_bytes(leaf, sizes, rank_fraction, 1) // _q_split(leaf, sizes, rank_fraction, split_q)
    return 2 * local_bytes(leaf, sizes) + q
  return local_bytes(leaf, sizes) + _state(leaf, sizes, optimizer, 1)


def chunks(params: Sequence[Leaf], sizes: dict[str, int], optimizer: str, rank_fraction: float = 0.25,
           split_q: bool = False, megabatch_bytes: int | None = None) -> list[list[Leaf]]:
  """The matrices the update steps as one: the megabatches, or with ``megabatch_bytes``
  (``--megabatch-mib``) each cut into chunks of max(1, megabatch_bytes // s) parameters, s
  one parameter's gradient and state per device (``dion_jax.optimizers.skeleton``)."""
  out = []
  for same in _megabatches(params, optimizer):
    size = len(same) if megabatch_bytes is None else max(
        1, megabatch_bytes // _leaf_bytes(same[0], sizes, optimizer, rank_fraction, split_q))
    out += [same[k:k + size] for k in range(0, len(same), size)]
  return out


def update_memory(params: Sequence[Leaf], sizes: dict[str, int], optimizer: str, rank_fraction: float = 0.25,
                  split_q: bool = False, megabatch_bytes: int | None = None, per_replica: bool = True) -> int:
  """The update's temporaries beside the state, per device: each chunk (:func:`chunks`)
  stacks a float32 copy of its gradients and state; Muon and Dion2 move their blocks in
  bfloat16 (half the gradients); AdamW works in place. XLA runs the megabatches side by
  side, so without ``megabatch_bytes`` the update holds all of them; with it, the chunks run
  one after another and the update holds the largest. Beside them, what XLA:CPU allocates
  at the step's start for every chunk, whatever their order: Dion's split Q held whole
  (:func:`_gathered_q`) and its factorizations' outputs (:func:`_factor_outputs`).

  Dion's P (b x rows/R x r, whole where the matrices do not split over its group) is not
  counted: it lives only inside the update, below the step's peak in every case measured
  (``docs/planning.md``), where the outputs above are live at the peak."""
  if optimizer == "adamw":
    return 0
  copies, hoisted = [], 0
  for same in chunks(params, sizes, optimizer, rank_fraction, split_q, megabatch_bytes):
    leaf, n = same[0], len(same)
    if optimizer == "dion":
      copies.append(n * _leaf_bytes(leaf, sizes, optimizer, rank_fraction, split_q))
      hoisted += (_gathered_q(leaf, n, sizes, rank_fraction, split_q)
                  + _factor_outputs(leaf, n, sizes, rank_fraction, per_replica))
    else:
      copies.append(n * local_bytes(leaf, sizes) // 2)
  return hoisted + (sum(copies) if megabatch_bytes is None else max(copies, default=0))


def _factor_outputs(leaf: Leaf, stacked: int, sizes: dict[str, int], rank_fraction: float, per_replica: bool) -> int:
  """The outputs of Dion's small factorizations for a chunk of ``stacked`` parameters, float32
  per matrix this device orthonormalizes (b, or b over P's group where they split it): with
  RCQR four r x r (the sketch's R, its inverse, the Gram's Cholesky factor, its inverse),
  with Householder (rows <= r: P gathered over the rows' axes) Q, rows x r
  (``dion_jax.linalg.qr``). On a CPU each is a loop's stacked output (``lax.map``,
  ``dion_jax.kernels.lapack``) whose zero-filled buffer XLA fills at the step's start, every
  chunk's (a constant, which the chunks' barriers do not order), and holds through the
  forward and backward passes. They grow as r², beyond P's rows/R x r where tp splits the
  rows: the term whose absence put the plan below the compiled step at full rank on tp
  (tiny fs=2,tp=4 at rank 1: one [6, 128, 128] and nine [2, 128, 128] float32 buffers,
  1.5 MiB, live at the forward's end; the plan 0.986 of the step without them, 1.099 with).
  On fs=8 they are the buffers a whole P per megabatch stood for before (3.0 MiB there)."""
  fr = matrix_frame(leaf.shape, DionDimensionNumbers(), rank_fraction, 1, leaf.spec, leaf.name)
  compressed = per_replica and sizes["rp"] > 1 and fr.compressible
  p_group = live(sizes, live(sizes, [leaf.spec[fr.col_axis]]) + (("rp",) if compressed else ()))
  shape = local_shape(leaf, sizes)
  b = stacked * math.prod(shape[a] for a in fr.batch_axes)
  matrices = b // group(sizes, p_group) if p_group and b % group(sizes, p_group) == 0 else b
  per_matrix = fr.rows * fr.rank if fr.rows <= fr.rank else 4 * fr.rank * fr.rank
  return matrices * per_matrix * 4


def _gathered_q(leaf: Leaf, stacked: int, sizes: dict[str, int], rank_fraction: float, split_q: bool) -> int:
  """With ``split_q``, what the update holds of a megabatch's split Q beyond the r/R columns
  its copy of the state counts: the whole Q gathered, and the new one whole before its slice.
  The update then holds one whole Q more than the unsplit layout's, so the split alone saves
  memory between steps, not at the update's peak (measured, the trainer's compiled step,
  tiny at rank 1 and 1/2 on fs=4,tp=2 and fs=2,tp=4: the temporaries grow by 5/6 of Q,
  the arguments drop by (R - 1)/R of it). In chunks (``megabatch_bytes``) XLA:CPU gathers
  every chunk's Q at the step's start all the same (tiny fs=2,tp=4 at rank 1, chunks of one
  parameter: six of the eight gathered Qs, 131,072 bytes each, live from the forward pass to
  the update; the plan 0.988 of the compiled step when it counted one chunk's)."""
  split = _q_split(leaf, sizes, rank_fraction, split_q)
  if split == 1:
    return 0
  q = _q_bytes(leaf, sizes, rank_fraction, stacked)
  return 2 * q - q // split
