"""Dion's matrix algebra as an optax transformation: ``scale_by_dion``.

Dion (Ahn, Xu, Abreu, Langford, "Dion: Distributed Orthonormalized Updates",
arXiv 2504.05295) keeps, per matrix, a momentum M (the parameter's shape) and a
right factor Q (cols x r). With B the momentum in the working frame (rows x cols,
see ``dion_jax.frame``), one step on gradient G is:

    M ← M + G
    P ← orthonormalize(B Q)                      P: rows x r
    R ← Bᵀ P                                     R: cols x r
    M ← M − (1 − mu) P Rᵀ                        error feedback (in B's frame)
    Q ← R / (‖R‖_col + eps)                      column norms in float32
    U ← scale(fan_out, fan_in) · P Qᵀ            the returned update direction

with a guard: if M is all zero, P = 0 and R = Q (the state is left alone), else
NaN/Inf in P and R are replaced by finite values. ``power_iters > 1`` repeats the
P/R products with Q ← R. Weight decay and the learning rate are applied by the
transformations chained after this one (``dion_jax.optimizer``), which gives the
reference's ``X ← (1 − lr·wd) X − lr·scale·P Qᵀ``.

Every line above is local to a device except a few small reductions, named by
:class:`Collectives`: sums over the mesh axes that shard B's columns (P = B Q and
the column norms) and rows (the orthonormalization's sketch and Gram, R = Bᵀ P),
and a mean of P and R over data-parallel replicas (compressed sync). On one device
all are identities; ``dion_jax.sharded`` runs the same function inside ``shard_map``.
"""

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dion_jax import frame as frame_lib
from dion_jax import orthogonalize
from dion_jax import sketch

AxisName = orthogonalize.AxisName


class Collectives(NamedTuple):
  """Mesh axes for the reductions of one matrix step (None: not sharded)."""

  rows: AxisName = None  # Axes sharding B's rows: sums for orthonormalization and R.
  cols: AxisName = None  # Axes sharding B's columns: sums for P and Q's column norms.
  replica: AxisName = None  # Replica axes over which P and R are averaged.
  everywhere: AxisName = None  # All mesh axes a matrix spans, for the all-zero guard.
  spread: bool = False  # Split the batch's orthonormalizations over cols + replica axes.


class DionHyperParams(NamedTuple):
  """Hyper-parameters of the matrix step (see :func:`scale_by_dion`)."""

  mu: Any = 0.95
  epsilon: Any = 1e-8
  qr_method: str = "rcqr"
  oversample: float = 1.25
  power_iters: int = 1
  backend: str = "auto"


class ScaleByDionState(NamedTuple):
  """State of :func:`scale_by_dion`.

  Attributes:
    count: number of steps taken, int32.
    momentum: per Dion parameter, M in the parameter's own layout (and dtype
      ``momentum_dtype``); with compressed data-parallel sync on a mesh, with a
      leading replica axis (see ``dion_jax.sharded``).
    q: per Dion parameter, Q of shape (*batch, cols, r): (fan_in, r), or (fan_out, r)
      when fan_out < fan_in, as in the reference.
  """

  count: jax.Array
  momentum: optax.Updates
  q: optax.Updates


def _names(axis_name: AxisName) -> tuple[str, ...]:
  if not axis_name:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _sum_then_mean(x: jax.Array, sum_axes: AxisName, mean_axes: AxisName) -> jax.Array:
  """``pmean(psum(x, sum_axes), mean_axes)`` as one all-reduce over both axis sets.

  One collective over the joint group moves each partial sum once; two nested ones
  would reduce over ``mean_axes`` a value already replicated over ``sum_axes``.
  """
  axes = _names(sum_axes) + _names(mean_axes)
  if not axes:
    return x
  x = jax.lax.psum(x, axes)
  return x / jax.lax.psum(1, mean_axes) if mean_axes else x


def _matmul(a, b, dtype):
  return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _orthonormalize_batch(P_bxrxr, seeds_b, use_cqr, hp: DionHyperParams, axes: Collectives):
  ortho = lambda P, seed: orthogonalize.orthonormalize(
      P, method=hp.qr_method, seed=seed, oversample=hp.oversample, use_cqr=use_cqr,
      axis_name=axes.rows, backend=hp.backend,
  )  # fmt: skip
  return jax.vmap(ortho)(P_bxrxr, seeds_b)


def _power_left(MR_partial_bxrxr, seeds_b, use_cqr, hp: DionHyperParams, axes: Collectives):
  """Reduces the partial products B Q over columns (and replicas), orthonormalizes them.

  With ``axes.spread``, the reduction is a reduce-scatter along the batch, so each
  device of the column/replica group orthonormalizes its own share of the matrices,
  and an all-gather brings every P back: the same bytes on the wire as an
  all-reduce, 1/group of the orthonormalization work.
  """
  group = _names(axes.cols) + _names(axes.replica)
  if not (axes.spread and group):
    P = _sum_then_mean(MR_partial_bxrxr, axes.cols, axes.replica)
    return _orthonormalize_batch(P, seeds_b, use_cqr, hp, axes)
  P_local = jax.lax.psum_scatter(MR_partial_bxrxr, group, scatter_dimension=0, tiled=True)
  if axes.replica:
    P_local = P_local / jax.lax.psum(1, axes.replica)
  share = P_local.shape[0]
  seeds_local = jax.lax.dynamic_slice_in_dim(seeds_b, jax.lax.axis_index(group) * share, share)
  P_local = _orthonormalize_batch(P_local, seeds_local, use_cqr, hp, axes)
  return jax.lax.all_gather(P_local, group, axis=0, tiled=True, to="invarying")


def _contract(M: jax.Array, X: jax.Array, over_last: bool) -> jax.Array:
  """``M`` (B, a, c) times ``X`` over one matrix axis of M, float32 accumulation.

  ``over_last``: Σ_c M[a, c] X[c, r] -> (B, a, r); else Σ_a M[a, c] X[a, r] -> (B, c, r).
  The second form is computed as (Xᵀ M)ᵀ with the small transposes kept out of
  the dot by optimization barriers: XLA would fold them back into a transposed-LHS
  GEMM, which runs at 40-50% of the plain one's speed on CPU (216 against
  392 GFLOP/s for 6 x (2048 x 512)ᵀ(2048 x 128) here).
  """
  if over_last:
    return jnp.einsum("bac,bcr->bar", M, X, preferred_element_type=jnp.float32)
  barrier = jax.lax.optimization_barrier if jax.default_backend() == "cpu" else (lambda x: x)
  Xt_bxrxa = barrier(jnp.swapaxes(X, 1, 2))
  out_bxrxc = barrier(jnp.einsum("bra,bac->brc", Xt_bxrxa, M, preferred_element_type=jnp.float32))
  return jnp.swapaxes(out_bxrxc, 1, 2)


def dion_matrix_step(
    M: jax.Array,
    G: jax.Array,
    Q_bxcxr: jax.Array,
    seeds_b: jax.Array,
    use_cqr: jax.Array,
    scale: float,
    hp: DionHyperParams,
    axes: Collectives = Collectives(),
    rows_last: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One Dion step on a batch of B matrices (this device's block of them).

  Args:
    M: momentum, (B, rows, cols), or (B, cols, rows) when ``rows_last``: B's matrices
      are read in the parameter's own layout, never transposed in memory.
    G: gradient, same layout.
    Q_bxcxr: right factor, (B, cols, r), rows split like M's columns.
    seeds_b: uint32 seeds of this step's RCQR sketches, (B,), the same on every replica.
    use_cqr: whether ``"cqr"`` may run (after warmup).
    scale: the shape-dependent update scale.
    hp: hyper-parameters.
    axes: mesh axes of the reductions.
    rows_last: the layout of M and G (above).

  Returns:
    ``(M, Q, U)``: the new momentum and Q, and the update ``scale·P Qᵀ`` in M's
    layout and dtype.
  """
  mat = "bnm" if rows_last else "bmn"  # m: rows of B, n: its columns, r: rank.
  mm = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  B_times = lambda X: _contract(M, X, over_last=not rows_last)  # B X
  Bt_times = lambda X: _contract(M, X, over_last=rows_last)  # Bᵀ X
  dtype = M.dtype
  M = M + G.astype(dtype)
  Q0_bxcxr = Q_bxcxr.astype(dtype)
  R_bxcxr = Q0_bxcxr
  for _ in range(hp.power_iters):
    P_bxrxr = _power_left(B_times(R_bxcxr), seeds_b, use_cqr, hp, axes).astype(dtype)
    R_bxcxr = _sum_then_mean(Bt_times(P_bxrxr), axes.rows, axes.replica).astype(dtype)

  nonzero_b = orthogonalize.psum(jnp.any(M != 0, axis=(1, 2)).astype(jnp.int32), axes.everywhere) > 0
  nonzero_b = nonzero_b[:, None, None]
  P_bxrxr = jnp.where(nonzero_b, jnp.nan_to_num(P_bxrxr), 0)
  R_bxcxr = jnp.where(nonzero_b, jnp.nan_to_num(R_bxcxr), Q0_bxcxr)

  M = M - ((1 - hp.mu) * mm(f"bmr,bnr->{mat}", P_bxrxr, R_bxcxr)).astype(dtype)
  R32_bxcxr = R_bxcxr.astype(jnp.float32)
  col_norm_bx1xr = jnp.sqrt(orthogonalize.psum(jnp.sum(R32_bxcxr**2, axis=1, keepdims=True), axes.cols))
  Q_bxcxr = (R32_bxcxr / (col_norm_bx1xr + hp.epsilon)).astype(dtype)
  U = scale * mm(f"bmr,bnr->{mat}", P_bxrxr, Q_bxcxr)
  return M, Q_bxcxr, U.astype(dtype)


def step_seeds(base_seed: int, step: jax.Array, leaf_id: int, batch_shape: tuple[int, ...]) -> jax.Array:
  """uint32 sketch seeds, one per matrix of a stacked parameter, for this step."""
  batch_index = jnp.arange(math.prod(batch_shape), dtype=jnp.uint32)
  return sketch.mix_seed(base_seed, step, leaf_id, batch_index).reshape(batch_shape)


def update_batched(
    fr: frame_lib.MatrixFrame,
    M: jax.Array,
    G: jax.Array,
    Q: jax.Array,
    seeds: jax.Array,
    use_cqr: jax.Array,
    scale: float,
    hp: DionHyperParams,
    axes: Collectives = Collectives(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`dion_matrix_step` on every matrix of a (stacked) parameter.

  ``M`` and ``G`` are in the parameter's layout (or this device's block of it),
  ``Q`` is (*batch, cols, r) and ``seeds`` is (*batch,). Returns ``(M, Q, U)`` with
  ``U`` in the parameter's layout.
  """
  M, G = fr.to_batch_first(M), fr.to_batch_first(G)
  batch = M.shape[:-2]
  flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])
  M, Q, U = dion_matrix_step(
      flat(M), flat(G), flat(Q), seeds.reshape(-1), use_cqr, scale, hp, axes, fr.rows_last
  )
  unflat = lambda x: x.reshape(batch + x.shape[1:])
  return fr.from_batch_first(unflat(M)), unflat(Q), fr.from_batch_first(unflat(U))


def scale_rule_fn(scale_rule: str | Callable[[int, int], float]) -> Callable[[int, int], float]:
  if callable(scale_rule):
    return scale_rule
  if scale_rule not in frame_lib.SCALE_RULES:
    raise ValueError(f"scale_rule must be one of {tuple(frame_lib.SCALE_RULES)} or a callable, got {scale_rule!r}")
  return frame_lib.SCALE_RULES[scale_rule]


def _by_path(tree, is_leaf) -> dict[str, Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def leaf_frames(
    params: optax.Params,
    *,
    rank_fraction: float,
    rank_multiple_of: int,
    dimension_numbers=None,
    partition_specs=None,
) -> list[frame_lib.MatrixFrame]:
  """The :class:`~dion_jax.frame.MatrixFrame` of every leaf of ``params``, in flatten order.

  ``dimension_numbers`` is None (Flax kernel default), one ``DionDimensionNumbers``,
  a pytree of them matching ``params`` (matched by path, so a tree masked by
  ``optax.partition`` works), or a callable ``params -> such a tree``.
  ``partition_specs`` is None or a matching pytree of ``PartitionSpec``.
  """
  is_dims = lambda x: x is None or isinstance(x, frame_lib.DionDimensionNumbers)
  if callable(dimension_numbers):
    dimension_numbers = dimension_numbers(params)
  if dimension_numbers is None or isinstance(dimension_numbers, frame_lib.DionDimensionNumbers):
    default, dims_by_path = dimension_numbers or frame_lib.DionDimensionNumbers(), {}
  else:
    default, dims_by_path = frame_lib.DionDimensionNumbers(), _by_path(dimension_numbers, is_dims)
  specs_by_path = {}
  if partition_specs is not None:
    is_spec = lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)
    specs_by_path = _by_path(partition_specs, is_spec)
  frames = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    frames.append(
        frame_lib.matrix_frame(
            tuple(leaf.shape),
            dims_by_path.get(name) or default,
            rank_fraction,
            rank_multiple_of,
            specs_by_path.get(name),
            name=f"parameter {name or '<root>'}",
        )
    )
  return frames


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_hyperparams(**values) -> None:
  """Raises ValueError naming the first bad hyper-parameter and its accepted values."""
  rules = {
      "rank_fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
      "rank_multiple_of": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
      "mu": (lambda v: v >= 0, "a number >= 0"),
      "epsilon": (lambda v: v >= 0, "a number >= 0"),
      "weight_decay": (lambda v: v >= 0, "a number >= 0"),
      "learning_rate": (lambda v: v >= 0, "a number >= 0 or an optax schedule"),
      "oversample": (lambda v: v >= 1, "a number >= 1"),
      "power_iters": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
      "cqr_warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
  }
  choices = {"qr_method": orthogonalize.METHODS, "backend": orthogonalize.BACKENDS}
  for name, value in values.items():
    if name in choices:
      if value not in choices[name]:
        raise ValueError(f"{name}={value!r} is not supported; use one of {choices[name]}")
    elif _is_number(value) and not rules[name][0](value):  # Arrays (inject_hyperparams) pass.
      raise ValueError(f"{name}={value!r} is invalid; it must be {rules[name][1]}")


def scale_by_dion(
    rank_fraction: float = 1.0,
    rank_multiple_of: int = 1,
    mu: float = 0.95,
    epsilon: float = 1e-8,
    qr_method: str = "rcqr",
    cqr_warmup_steps: int = 150,
    oversample: float = 1.25,
    power_iters: int = 1,
    scale_rule: str | Callable[[int, int], float] = "fan_ratio",
    momentum_dtype: Any = None,
    q_dtype: Any = None,
    seed: int = 0,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
) -> optax.GradientTransformation:
  """Dion's orthonormalized low-rank update direction for matrix parameters.

  Returns ``scale·P Qᵀ`` per matrix (module docstring); chain weight decay and the
  learning rate after it, or use :func:`dion_jax.optimizer.dion`, which also routes
  non-matrix parameters to a scalar optimizer.

  Args:
    rank_fraction: r / min(m, n), in (0, 1].
    rank_multiple_of: round r up to a multiple of this (then clip to min(m, n)).
    mu: momentum decay of the error feedback, ``M ← M − (1 − mu) P Rᵀ``.
    epsilon: added to Q's column norms.
    qr_method: ``"rcqr"`` (randomized Cholesky QR), ``"cqr"`` (Cholesky QR after
      ``cqr_warmup_steps`` steps, RCQR before and whenever Cholesky fails) or
      ``"qr"`` (Householder).
    cqr_warmup_steps: see ``qr_method``.
    oversample: RCQR sketch rows per rank, before rounding up to a multiple of 128.
    power_iters: power-iteration steps per update.
    scale_rule: update scale from (fan_out, fan_in): ``"fan_ratio"`` (the reference,
      sqrt(fan_out/fan_in)), ``"spectral"`` (0.2·sqrt(max)), ``"max_one"``
      (sqrt(max(1, fan_out/fan_in))), ``"none"``, or a callable.
    momentum_dtype: dtype of M (default: the parameter's).
    q_dtype: dtype of Q (default: the parameter's).
    seed: seeds Q's initialization and the RCQR sketches.
    dimension_numbers: fan_in/fan_out axes (see :func:`leaf_frames`).
    partition_specs: PartitionSpecs of the parameters: decide each matrix's frame
      (the "tp" axis gives the rows) and, with ``mesh``, how it is sharded.
    mesh: run the matrix algebra inside ``shard_map`` over this mesh
      (``dion_jax.sharded``).
    replicate_sync: with a mesh whose "rp" axis is > 1: gradients of Dion matrices
      arrive per replica (leading replica axis) and only P and R are averaged
      (compressed sync) where that moves fewer bytes; False: gradients arrive averaged.
    backend: orthonormalization passes: ``"auto"``, ``"xla"`` or ``"pallas"``.
  """
  check_hyperparams(
      rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of, mu=mu, epsilon=epsilon,
      qr_method=qr_method, cqr_warmup_steps=cqr_warmup_steps, oversample=oversample,
      power_iters=power_iters, backend=backend,
  )  # fmt: skip
  scale_of = scale_rule_fn(scale_rule)
  hp = DionHyperParams(mu, epsilon, qr_method, oversample, power_iters, backend)
  frames_of = lambda tree: leaf_frames(
      tree,
      rank_fraction=rank_fraction,
      rank_multiple_of=rank_multiple_of,
      dimension_numbers=dimension_numbers,
      partition_specs=partition_specs,
  )
  if mesh is not None:
    from dion_jax import sharded  # The sharded path builds on this module.

    layout = sharded.Layout(mesh, replicate_sync)

  def init_fn(params):
    frames = frames_of(params)
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.key(seed)
    momentum, q = [], []
    for i, (p, fr) in enumerate(zip(leaves, frames)):
      m_dtype, qdt = momentum_dtype or p.dtype, q_dtype or p.dtype
      Q = jax.random.normal(jax.random.fold_in(key, i), fr.q_shape, jnp.float32).astype(qdt)
      if mesh is None:
        momentum.append(jnp.zeros(p.shape, m_dtype))
        q.append(Q)
      else:
        momentum.append(layout.init_momentum(fr, m_dtype))
        q.append(layout.constrain_q(fr, Q))
    return ScaleByDionState(
        count=jnp.zeros([], jnp.int32),
        momentum=jax.tree.unflatten(treedef, momentum),
        q=jax.tree.unflatten(treedef, q),
    )

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    momentum, q = treedef.flatten_up_to(state.momentum), treedef.flatten_up_to(state.q)
    shapes = leaves if mesh is None else [layout.param_struct(g) for g in leaves]
    frames = frames_of(jax.tree.unflatten(treedef, shapes))
    count = optax.safe_increment(state.count)
    use_cqr = count > cqr_warmup_steps
    new_m, new_q, out = [], [], []
    for i, (g, M, Q0, fr) in enumerate(zip(leaves, momentum, q, frames)):
      seeds = step_seeds(seed, count, i, fr.batch_shape)
      scale = scale_of(fr.fan_out, fr.fan_in)
      if mesh is None:
        M, Q, U = update_batched(fr, M, g, Q0, seeds, use_cqr, scale, hp)
      else:
        M, Q, U = layout.update(fr, M, g, Q0, seeds, use_cqr, scale, hp)
      new_m.append(M)
      new_q.append(Q.astype(Q0.dtype))
      out.append(U.astype(g.dtype))
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(out), ScaleByDionState(count, unflat(new_m), unflat(new_q))

  return optax.GradientTransformation(init_fn, update_fn)
