"""Dion (arXiv 2504.05295): ``scale_by_dion``, its matrix step on the shared skeleton,
and the whole optimizer ``dion`` (Dion for matrices, AdamW or Lion for the rest).

The matrix algebra is ``dion_jax.optimizers.dion_math``; this module adds the state
(M in the parameter's layout, Q of shape (*batch, cols, r)), the step seeds, and the
placement on a mesh. Parameters of one geometry (shape, frame, PartitionSpec, dtypes)
are stepped as one stacked megabatch (``dion_jax.optimizers.skeleton``): each matrix's
step is its own, so the result is each parameter's alone, with one orthonormalization
chain and one set of reductions per group. With B's rows sharded over ``rows`` axes and
its columns over ``cols`` axes (docs/design.md §3), each megabatch's step runs on its
local block and reduces

    P = B Q            psum over cols           (rows/tp x r)
    PᵀP, ‖P‖_F²        psum over rows           (r x r), (1,); rcqr's S P (k x r)
    R = Bᵀ P           psum over rows           (cols/fs x r)
    ‖R‖_col            psum over cols           (r,)

while batch axes (layers, stages on ``pp``, the megabatch) never communicate. After the sum
over ``cols`` every device of a column group holds the same P; when the local batch of
matrices (stacked parameters and layers) divides the group, the sum is a reduce-scatter along the
batch instead, each device orthonormalizes its share, and an all-gather restores P
(as the reference does): the same bytes on the wire, 1/group of the work.

Q's layout. Q (*batch, cols, r) is split like B's columns and, by default, replicated over
the axes that split B's rows (tp): on tp=8 each device holds 1/8 of M but all of Q. With
``split_q`` its r is split over those axes too (ZeRO-style): the step all-gathers it
(cols/C x r per matrix, over the rows), runs as above, and keeps its own r/R columns of
the new Q, which every device of the row group computes alike (R is summed over rows).
Dion2 and NorDion2 keep no Q (only M, and NorDion2 a second moment per neuron, both
sharded like the parameter): there is nothing of theirs to split.

Data-parallel replicas (``rp``). With ``replicate_sync`` and rp > 1, Dion matrices
get their gradient per replica (``dion_jax.value_and_grad_per_replica``). Then, per
matrix:

- compressed sync, when ``(rows + cols)·r < rows·cols``: every replica keeps its own
  momentum (stored with a leading replica axis) and only P and R are averaged over
  ``rp``: ``(rows + cols)·r`` values instead of ``rows·cols``. Since every step is
  linear in M, the parameters follow Dion on the averaged gradient exactly; the
  replicas' momenta differ but their mean is the single-device one.
- otherwise the gradient is averaged over ``rp`` first and the momentum is
  replicated like the parameter.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from dion_jax import validation
from dion_jax.kernels import backend as backend_lib
from dion_jax.kernels import sketch
from dion_jax.linalg import qr, tf32
from dion_jax.optimizers import dion_math
from dion_jax.optimizers.frame import MatrixFrame, MatrixView, leaf_views
from dion_jax.optimizers.routing import matrix_optimizer
from dion_jax.optimizers.skeleton import MatrixRule, scale_by_matrix_rule
from dion_jax.parallel import collectives
from dion_jax.parallel.layout import Layout, Placement
from dion_jax.parallel.mesh import REPLICA_AXIS, axis_names

# Structural arguments. optax.inject_hyperparams(dion)(learning_rate=...) works bare, as
# optax's own aliases do: every number it turns into an array (lr, mu, weight decays, betas,
# epsilons, seed, cqr_warmup_steps) works as one, and the structural ones default to None.
# To pass structural numbers or callables (the rank, labels, scale_rule, dimension_numbers,
# dtypes such as jnp.bfloat16, which it would take for schedules), name them static:
#   optax.inject_hyperparams(dion, static_args=dion_jax.STATIC_ARGS)(learning_rate=..., rank_fraction=0.25)
# Without, they arrive as arrays, and the first call says so in one line.
STATIC_ARGS = (
    "rank_fraction", "rank_multiple_of", "oversample", "power_iters", "cqr_warmup_steps",
    "seed", "lm_head_lr_scale", "labels", "scale_rule", "dimension_numbers",
    "momentum_dtype", "q_dtype", "mixed_precision", "cautious_wd", "split_q", "megabatch_bytes",
)  # fmt: skip


class ScaleByDionState(NamedTuple):
  """State of :func:`scale_by_dion`.

  Attributes:
    count: number of steps taken, int32.
    momentum: per Dion parameter, M in the parameter's own layout (and dtype
      ``momentum_dtype``); with compressed data-parallel sync on a mesh, with a
      leading replica axis (module docstring).
    q: per Dion parameter, Q of shape (*batch, cols, r): (fan_in, r), or (fan_out, r)
      when fan_out < fan_in, as in the reference. On a mesh its cols are split like the
      matrix's columns and, with ``split_q``, its r over the matrix's row axes.
  """

  count: jax.Array
  momentum: optax.Updates
  q: optax.Updates


def leaf_frames(
    params: optax.Params,
    *,
    rank_fraction: float,
    rank_multiple_of: int,
    dimension_numbers=None,
    partition_specs=None,
) -> list[MatrixFrame]:
  """The :class:`~dion_jax.MatrixFrame` of every leaf of ``params``, in flatten order.

  ``dimension_numbers`` is None (Flax kernel default), one ``DionDimensionNumbers``,
  a pytree of them matching ``params`` (matched by path, so a tree masked by
  ``optax.partition`` works), or a callable ``params -> such a tree``;
  ``partition_specs`` likewise with ``PartitionSpec``.
  """
  views = leaf_views(params, dimension_numbers=dimension_numbers, partition_specs=partition_specs,
                     rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of)
  return [v.frame for v in views]


def _compressed(fr: MatrixFrame, layout: Layout) -> bool:
  """Whether P and R are averaged over replicas instead of the gradient."""
  return layout.per_replica and fr.compressible


def _q_rank_axes(fr: MatrixFrame, layout: Layout, split_q: bool) -> tuple[str, ...]:
  """The mesh axes that split Q's r: with ``split_q``, those that split B's rows, where
  they span more than one device and r divides by their size; else none."""
  rows = axis_names(fr.spec[fr.row_axis])
  size = layout.size(rows)
  return rows if split_q and size > 1 and fr.rank % size == 0 else ()


def _placement(split_q: bool):
  def placement(view: MatrixView, layout: Layout) -> Placement:
    fr = view.frame
    spec = layout.check(fr.shape, fr.spec, fr.name)
    rank_axes = _q_rank_axes(fr, layout, split_q)
    q_spec = P(*(spec[a] for a in fr.batch_axes), spec[fr.col_axis], spec[fr.row_axis] if rank_axes else None)
    compressed = _compressed(fr, layout)
    return Placement(P(*spec), (P(*spec), q_spec), (compressed, False), own_gradient=compressed)

  return placement


def _collectives(fr: MatrixFrame, layout: Layout, compressed: bool) -> dion_math.Collectives:
  rows, cols = axis_names(fr.spec[fr.row_axis]), axis_names(fr.spec[fr.col_axis])
  replica = (REPLICA_AXIS,) if compressed else ()
  local_batch = math.prod(n // layout.size(axis_names(fr.spec[a])) for a, n in zip(fr.batch_axes, fr.batch_shape))
  return dion_math.Collectives(
      rows=rows or None,
      cols=cols or None,
      replica=replica or None,
      everywhere=(rows + cols + replica) or None,
      spread=local_batch % layout.size(cols + replica) == 0,
  )


def scale_by_dion(
    rank_fraction: float | None = None,
    rank_multiple_of: int | None = None,
    mu: float = 0.95,
    epsilon: float = 1e-8,
    qr_method: str = "auto",
    cqr_warmup_steps: int = 150,
    oversample: float | None = None,
    power_iters: int | None = None,
    scale_rule: str | Callable[[int, int], float] = "fan_ratio",
    momentum_dtype: Any = None,
    q_dtype: Any = None,
    mixed_precision: bool = False,
    power_precision: str | None = None,
    qr_precision: str = "float32",
    seed: int = 0,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
    split_q: bool = False,
    megabatch_bytes: int | None = None,
) -> optax.GradientTransformation:
  """Dion's orthonormalized low-rank update direction for matrix parameters.

  Returns ``scale·P Qᵀ`` per matrix (``dion_jax.optimizers.dion_math``); chain weight
  decay and the learning rate after it, or use :func:`dion`, which also routes
  non-matrix parameters to a scalar optimizer.

  Args:
    rank_fraction: r / min(m, n), in (0, 1] (None: 1, full rank).
    rank_multiple_of: round r up to a multiple of this (then clip to min(m, n); None: 1).
    mu: momentum decay of the error feedback, ``M ← M − (1 − mu) P Rᵀ``.
    epsilon: added to Q's column norms.
    qr_method: ``"auto"`` (``"shifted_cqr"`` on a GPU, ``"rcqr"`` elsewhere: the faster
      of the two on each, measured), ``"shifted_cqr"`` (Cholesky QR in four passes after a fill, batched
      over the matrices with no loop or branch: fit for a GPU), ``"cqr"`` (one-pass
      Cholesky QR after ``cqr_warmup_steps`` steps where its Cholesky succeeds,
      ``"shifted_cqr"`` elsewhere), ``"rcqr"`` (randomized Cholesky QR, the
      reference's), ``"qr"`` (Householder) or ``"polar"`` (P's polar factor by Polar
      Express in bfloat16, Muon's arithmetic: no factorization, columns orthonormal to
      about 0.1); see ``dion_jax.linalg.qr``.
    cqr_warmup_steps: see ``qr_method``.
    oversample: RCQR sketch rows per rank, before rounding up to a multiple of 128
      (None: 1.25).
    power_iters: power-iteration steps per update (None: 1).
    scale_rule: update scale from (fan_out, fan_in): ``"fan_ratio"`` (the reference,
      sqrt(fan_out/fan_in)), ``"spectral"`` (0.2·sqrt(max)), ``"max_one"``
      (sqrt(max(1, fan_out/fan_in))), ``"none"``, or a callable.
    momentum_dtype: dtype of M (default: the parameter's).
    q_dtype: dtype of Q (default: the parameter's).
    mixed_precision: microsoft/dion's ``mixed_precision: true``: M and Q in bfloat16
      unless ``momentum_dtype``/``q_dtype`` say otherwise. The step's products then
      run in bfloat16 (float32 accumulation), the orthonormalization and Q's column
      norms in float32; the update keeps the parameter's dtype.
    power_precision: the inputs of the power iteration's products B Q and Bᵀ P, always
      accumulated in float32: None (XLA's default precision: TF32 on NVIDIA GPUs since
      Ampere, float32 on CPUs), ``"float32"``, ``"tensorfloat32"`` (TF32 inputs; on a CPU
      their rounding is emulated) or ``"bfloat16"``. The state keeps its dtype.
    qr_precision: the Grams and products ``P W`` of ``"shifted_cqr"``'s and ``"cqr"``'s
      Cholesky QR passes (nearly all their flops): ``"float32"`` (IEEE float32,
      the CUDA cores on a GPU) or ``"tensorfloat32x3"`` (three TF32 products per matmul on
      the tensor cores, XLA's ``TF32_TF32_F32_X3``: float32's accuracy; emulated on a CPU);
      see ``dion_jax.linalg.tf32``. Other methods ignore it.
    seed: seeds Q's initialization and the RCQR sketches.
    dimension_numbers: fan_in/fan_out axes (see :func:`leaf_frames`).
    partition_specs: PartitionSpecs of the parameters: decide each matrix's frame
      (the "tp" axis gives the rows) and, with ``mesh``, how it is sharded.
    mesh: run the matrix algebra inside ``shard_map`` over this mesh.
    replicate_sync: with a mesh whose "rp" axis is > 1: gradients of Dion matrices
      arrive per replica (leading replica axis) and only P and R are averaged
      (compressed sync) where that moves fewer bytes; False: gradients arrive averaged.
    backend: orthonormalization passes: ``"auto"``, ``"xla"`` or ``"pallas"``.
    split_q: on a mesh, store each Q (*batch, cols/C, r) with its r also split over the
      mesh axes that split the matrix's rows (tp, for both the column- and row-parallel
      orientation; any axis of the row's PartitionSpec entry), ZeRO-style: each device of
      a row group holds (*batch, cols/C, r/R) instead of a replica of the whole, the
      state's Q divided by R. The step all-gathers Q over those axes first (a transient
      full (b, cols/C, r) per megabatch, for B Q), runs unchanged, and keeps its own
      r/R columns of the new Q = R / ‖R‖_col, which is the same on every device of the
      row group (R is summed over the rows): one all-gather of Q, cols/C x r per matrix,
      over the row axes per step, nothing else, and the same numbers as without. Where
      the row axes span one device or do not divide r, that parameter keeps the
      unsplit layout. Off by default: the all-gather is one more collective on the
      step's path, and the update holds every megabatch's whole Q at once (measured on
      a compiled step), so the split saves memory between steps (the state, what sits
      beside it, a host copy), not at the update's peak unless ``megabatch_bytes`` bounds it.
    megabatch_bytes: None (every megabatch at once, the default), or bytes per device of
      one megabatch's stacked gradients and state: the megabatches are cut into chunks of
      at most that (at least one parameter) and stepped one after another, so the update
      holds one chunk's copy instead of every group's at once; the same numbers
      (``dion_jax.optimizers.skeleton``). With ``split_q``, XLA:CPU still gathers every
      chunk's Q at the step's start (measured, tiny fs=2,tp=4 at rank 1:
      ``train/run/plan/optimizer.py``), and each chunk's factorizations' outputs (CPU loops,
      ``dion_jax.kernels.lapack``) are allocated there too.
  """
  validation.check_static("STATIC_ARGS", rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of,
                          oversample=oversample, power_iters=power_iters, momentum_dtype=momentum_dtype,
                          q_dtype=q_dtype)
  rank_fraction = 1.0 if rank_fraction is None else rank_fraction
  rank_multiple_of = 1 if rank_multiple_of is None else rank_multiple_of
  oversample = 1.25 if oversample is None else oversample
  power_iters = 1 if power_iters is None else power_iters
  validation.check_numbers(
      rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of, mu=mu, epsilon=epsilon,
      cqr_warmup_steps=cqr_warmup_steps, oversample=oversample, power_iters=power_iters,
  )  # fmt: skip
  validation.check_choice("qr_method", qr_method, qr.METHODS)
  validation.check_choice("backend", backend, backend_lib.BACKENDS)
  validation.check_choice("power_precision", power_precision, dion_math.POWER_PRECISIONS)
  validation.check_choice("qr_precision", qr_precision, tf32.PRECISIONS)
  hp = dion_math.DionHyperParams(mu, epsilon, qr_method, oversample, power_iters, backend, power_precision,
                                 qr_precision)
  key = jax.random.key(seed)
  if mixed_precision:
    momentum_dtype, q_dtype = momentum_dtype or jnp.bfloat16, q_dtype or jnp.bfloat16

  def views(params):
    return leaf_views(params, dimension_numbers=dimension_numbers, partition_specs=partition_specs,
                      rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of)

  def init_leaf(view, p, index):
    Q = jax.random.normal(jax.random.fold_in(key, index), view.frame.q_shape, jnp.float32)
    return jnp.zeros(p.shape, momentum_dtype or p.dtype), Q.astype(q_dtype or p.dtype)

  def local_step(view, scale, layout, placement):
    fr = view.frame
    axes = dion_math.Collectives() if layout is None else _collectives(fr, layout, placement.own_gradient)
    rank_axes = () if layout is None else _q_rank_axes(fr, layout, split_q)

    def step(g, M, Q, seed, use_cqr):
      Q = collectives.gather(Q, rank_axes, -1)
      M, Q, U = dion_math.update_batched(fr, M, g, Q, seed, use_cqr, scale, hp, axes)
      return U, M, collectives.own_block(Q, rank_axes, -1)

    return step

  def step_args(count):
    return sketch.mix_seed(seed, count), count > cqr_warmup_steps

  rule = MatrixRule(ScaleByDionState, ("momentum", "q"), views, init_leaf, _placement(split_q), local_step, step_args,
                    megabatch=True)
  return scale_by_matrix_rule(rule, scale_rule, mesh, replicate_sync, megabatch_bytes)


def dion(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    rank_fraction: float | None = None,
    rank_multiple_of: int | None = None,
    mu: float = 0.95,
    weight_decay: float = 0.01,
    scalar_weight_decay: float | None = None,
    cautious_wd: bool = False,
    epsilon: float = 1e-8,
    qr_method: str = "auto",
    cqr_warmup_steps: int = 150,
    oversample: float | None = None,
    power_iters: int | None = None,
    scale_rule: str | Callable[[int, int], float] = "fan_ratio",
    momentum_dtype: Any = None,
    q_dtype: Any = None,
    mixed_precision: bool = False,
    power_precision: str | None = None,
    qr_precision: str = "float32",
    seed: int = 0,
    scalar_optimizer: str = "adamw",
    scalar_learning_rate: optax.ScalarOrSchedule | None = None,
    b1: float = 0.9,
    b2: float = 0.95,
    scalar_epsilon: float = 1e-8,
    lm_head_lr_scale: float | None = None,
    labels: Any = None,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
    split_q: bool = False,
    megabatch_bytes: int | None = None,
) -> optax.GradientTransformation:
  """Dion (arXiv 2504.05295) for matrices, AdamW or Lion for everything else.

  Args:
    learning_rate: base learning rate, a float or an optax schedule; Dion's update is
      further multiplied by its shape scale (``scale_rule``).
    rank_fraction, rank_multiple_of, mu, epsilon, qr_method, cqr_warmup_steps,
      oversample, power_iters, scale_rule, momentum_dtype, q_dtype, mixed_precision,
      power_precision, qr_precision, seed, dimension_numbers, partition_specs, mesh, replicate_sync, backend,
      split_q, megabatch_bytes: see :func:`scale_by_dion`.
    weight_decay: decoupled weight decay, multiplied by the base learning rate, for
      Dion and (unless ``scalar_weight_decay`` is given) the scalar optimizer.
    scalar_weight_decay: the scalar optimizer's weight decay, for embeddings, LM head
      and vectors (default: ``weight_decay``; the reference's recipe uses 0).
    cautious_wd: decay a matrix weight only where it agrees in sign with its update
      (:func:`dion_jax.add_decayed_weights`).
    scalar_optimizer: ``"adamw"`` or ``"lion"`` for non-matrix parameters,
      embeddings and the LM head.
    scalar_learning_rate: its learning rate (default: ``learning_rate``).
    b1, b2, scalar_epsilon: the scalar optimizer's betas and epsilon.
    lm_head_lr_scale: multiplier of the LM head's learning rate; None means
      1/sqrt(d_model) with Lion (the reference) and 1 with AdamW.
    labels: a pytree of labels from ``("dion", "adamw", "lion", "lm_head", "muon")``
      matching the parameters, or a callable ``params -> labels``; default
      :func:`dion_jax.default_labels`.

  Returns:
    An optax ``GradientTransformation``.
  """
  matrix = scale_by_dion(
      rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of, mu=mu,
      epsilon=epsilon, qr_method=qr_method, cqr_warmup_steps=cqr_warmup_steps,
      oversample=oversample, power_iters=power_iters, scale_rule=scale_rule,
      momentum_dtype=momentum_dtype, q_dtype=q_dtype, mixed_precision=mixed_precision,
      power_precision=power_precision, qr_precision=qr_precision, seed=seed,
      dimension_numbers=dimension_numbers, partition_specs=partition_specs,
      mesh=mesh, replicate_sync=replicate_sync, backend=backend, split_q=split_q,
      megabatch_bytes=megabatch_bytes,
  )  # fmt: skip
  return matrix_optimizer(
      matrix, learning_rate, weight_decay=weight_decay, scalar_weight_decay=scalar_weight_decay,
      cautious_wd=cautious_wd, mu=mu,
      scalar_optimizer=scalar_optimizer, scalar_learning_rate=scalar_learning_rate, b1=b1, b2=b2,
      scalar_epsilon=scalar_epsilon, lm_head_lr_scale=lm_head_lr_scale, labels=labels,
      dimension_numbers=dimension_numbers,
  )  # fmt: skip
