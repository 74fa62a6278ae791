"""``scale_by_dion``: Dion's matrix step (``dion_jax.core``) as an optax transformation.

It owns the per-parameter bookkeeping: which leaves are matrices and in which frame
(``dion_jax.frame``), the optimizer state, per-step sketch seeds, and the choice
between the single-device path and the sharded one (``dion_jax.sharded``).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dion_jax import core
from dion_jax import frame as frame_lib
from dion_jax import orthogonalize


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


def scale_rule_fn(scale_rule: str | Callable[[int, int], float] | None) -> Callable[[int, int], float]:
  """The rule ``(fan_out, fan_in) -> scale`` named by ``scale_rule`` (one of
  ``frame.SCALE_RULES``, an alias from ``frame.SCALE_RULE_ALIASES``, None for
  ``"none"``), or ``scale_rule`` itself when it is a callable."""
  if callable(scale_rule):
    return scale_rule
  name = "none" if scale_rule is None else frame_lib.SCALE_RULE_ALIASES.get(scale_rule, scale_rule)
  if name not in frame_lib.SCALE_RULES:
    accepted = tuple(frame_lib.SCALE_RULES) + tuple(frame_lib.SCALE_RULE_ALIASES)
    raise ValueError(f"scale_rule={scale_rule!r} is not supported; use one of {accepted}, None or a callable")
  return frame_lib.SCALE_RULES[name]


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
  hp = core.DionHyperParams(mu, epsilon, qr_method, oversample, power_iters, backend)
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
    sketch_seed = core.step_seed(seed, count)
    for g, M, Q0, fr in zip(leaves, momentum, q, frames):
      scale = scale_of(fr.fan_out, fr.fan_in)
      if mesh is None:
        M, Q, U = core.update_batched(fr, M, g, Q0, sketch_seed, use_cqr, scale, hp)
      else:
        M, Q, U = layout.update(fr, M, g, Q0, sketch_seed, use_cqr, scale, hp)
      new_m.append(M)
      new_q.append(Q.astype(Q0.dtype))
      out.append(U.astype(g.dtype))
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(out), ScaleByDionState(count, unflat(new_m), unflat(new_q))

  return optax.GradientTransformation(init_fn, update_fn)
