"""The one skeleton of every matrix optimizer here: per-parameter geometry and state,
and the step on one device or inside ``shard_map`` over the parameter's own layout.

An algorithm (Dion, Muon, NorMuon, Dion2) is a :class:`MatrixRule`: how it sees each
parameter (a :class:`~dion_jax.optimizers.frame.MatrixView`), the state arrays it keeps
per parameter and where they lie on a mesh, and its step on one parameter's block.
:func:`scale_by_matrix_rule` turns a rule into an optax transformation that returns
``scale·U`` per parameter, ``scale`` from ``scale_rule(fan_out, fan_in)``; weight decay
and the learning rate are chained after it (``dion_jax.optimizers.routing``).

A rule's per-step arguments (Dion's sketch seed) come from the step count, which the
state keeps when its type has a ``count`` field.

Megabatches (microsoft/dion's megabatching). A rule whose step treats every matrix of a
batch on its own (``MatrixRule.megabatch``: Dion, Muon, NorMuon, Dion2, NorDion2) runs once per
group of parameters of one geometry instead of once per parameter: leaves with equal
views but for their names (shape, dimension numbers, heads, PartitionSpec) and equal
dtypes are stacked along a new leading axis, stepped as one parameter, and unstacked. A
GPT's query, key, value and out kernels of all layers are then one batch of
orthogonalizations on one device (out apart where tensor parallelism shards it the
other way), its up and gate kernels another, its down kernels a third; on a mesh the
batch is split over the devices of each group (``dion_jax.parallel.megabatch``; Dion's
P over its column and replica group, ``dion_jax.optimizers.dion``). The state stays per
parameter: only the step stacks.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dion_jax.optimizers.frame import MatrixView, scale_rule_fn
from dion_jax.parallel.layout import Layout, Placement

# local(g, *state, *step_args) -> (update, *state), on one device or one block.
LocalStep = Callable[..., tuple]


class MatrixRule(NamedTuple):
  """One matrix algorithm on the skeleton.

  Attributes:
    state_type: the NamedTuple of the transformation's state. Its fields named in
      ``state_fields`` hold one tree of arrays each (like the parameters); a field
      ``count`` counts steps; other fields are left empty, ``()``.
    state_fields: the per-parameter state, in the order of ``init_leaf``'s arrays.
    views: ``params -> [MatrixView]``, one per leaf, in flatten order.
    init_leaf: ``(view, param, index) -> state arrays``, in the parameter's frame and
      on no mesh (``index``: the leaf's position in flatten order).
    placement: ``(view, layout) -> Placement`` of the parameter and its state on a
      mesh; raises ValueError for a layout the rule cannot run.
    local_step: ``(view, scale, layout, placement) -> LocalStep``; layout and
      placement are None on one device.
    step_args: ``count -> tuple`` of per-step arguments shared by every parameter
      (replicated on a mesh); ``count`` is None without a ``count`` field.
    megabatch: the step treats each matrix of a batch on its own, so parameters of one
      geometry may run as one stacked parameter (module docstring).
  """

  state_type: type
  state_fields: tuple[str, ...]
  views: Callable[[Any], list[MatrixView]]
  init_leaf: Callable[[MatrixView, jax.Array, int], tuple[jax.Array, ...]]
  placement: Callable[[MatrixView, Layout], Placement]
  local_step: Callable[[MatrixView, float, Layout | None, Placement | None], LocalStep]
  step_args: Callable[[jax.Array | None], tuple] = lambda count: ()
  megabatch: bool = False


def _state(rule: MatrixRule, treedef, per_field: list[list[jax.Array]], count) -> Any:
  trees = {f: jax.tree.unflatten(treedef, xs) for f, xs in zip(rule.state_fields, per_field)}
  if count is not None:
    trees["count"] = count
  return rule.state_type(**{name: trees.get(name, ()) for name in rule.state_type._fields})


def _groups(rule: MatrixRule, views: list[MatrixView], leaves: list, states: list[list]) -> list[list[int]]:
  """Leaf indices in flatten order, one list per megabatch (singletons unless ``rule.megabatch``)."""
  if not rule.megabatch:
    return [[i] for i in range(len(leaves))]
  groups: dict[Any, list[int]] = {}
  for i, (view, g) in enumerate(zip(views, leaves)):
    key = (view.unnamed(), g.shape, g.dtype, tuple((x.shape, x.dtype) for x in (field[i] for field in states)))
    groups.setdefault(key, []).append(i)
  return list(groups.values())


def scale_by_matrix_rule(
    rule: MatrixRule,
    scale_rule: str | Callable[[int, int], float] | None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
) -> optax.GradientTransformation:
  """The optax transformation of ``rule`` (module docstring).

  With ``mesh``, every parameter's step runs inside ``shard_map`` over its own
  PartitionSpec (``dion_jax.parallel.layout``); gradients arrive per replica when
  ``replicate_sync`` and the mesh has rp > 1.
  """
  scale_of = scale_rule_fn(scale_rule)
  layout = None if mesh is None else Layout(mesh, replicate_sync)
  counted = "count" in rule.state_type._fields

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    per_field = [[] for _ in rule.state_fields]
    for i, (p, view) in enumerate(zip(leaves, rule.views(params))):
      state = rule.init_leaf(view, p, i)
      if layout is not None:
        state = layout.place(rule.placement(view, layout), state)
      for field, x in zip(per_field, state):
        field.append(x)
    return _state(rule, treedef, per_field, jnp.zeros([], jnp.int32) if counted else None)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    old = [treedef.flatten_up_to(getattr(state, f)) for f in rule.state_fields]
    structs = leaves if layout is None else [layout.param_struct(g) for g in leaves]
    views = rule.views(jax.tree.unflatten(treedef, structs))
    count = optax.safe_increment(state.count) if counted else None
    args = rule.step_args(count)

    def step(view, g, leaf_state):
      scale = scale_of(view.frame.fan_out, view.frame.fan_in)
      if layout is None:
        return rule.local_step(view, scale, None, None)(g, *leaf_state, *args)
      placement = rule.placement(view, layout)
      return layout.run(rule.local_step(view, scale, layout, placement), placement, g, leaf_state, args)

    per_leaf = [None] * len(leaves)
    for group in _groups(rule, views, leaves, old):
      if len(group) == 1:
        i = group[0]
        per_leaf[i] = step(views[i], leaves[i], [field[i] for field in old])
        continue
      # A replica axis of the gradient or state, where there is one, stays in front of the
      # stacking axis; the update has none.
      g_axis = int(layout is not None and layout.per_replica)
      state_axes = [0] * len(old)
      if layout is not None:
        state_axes = [int(r) for r in rule.placement(views[group[0]], layout).state_per_replica]
      view = views[group[0]].stacked(len(group), ", ".join(views[i].frame.name for i in group))
      g = jnp.stack([leaves[i] for i in group], g_axis)
      stacked = [jnp.stack([field[i] for i in group], a) for field, a in zip(old, state_axes)]
      update, *stacked_new = step(view, g, stacked)
      for k, i in enumerate(group):
        # Static slices, not jnp.take's gathers: XLA fuses a slice into its consumer.
        per_leaf[i] = (update[k], *(jax.lax.index_in_dim(x, k, a, keepdims=False)
                                    for x, a in zip(stacked_new, state_axes)))
    out, new = [], [[] for _ in rule.state_fields]
    for g, (update, *leaf_new), *leaf_state in zip(leaves, per_leaf, *old):
      out.append(update.astype(g.dtype))
      for field, x, x0 in zip(new, leaf_new, leaf_state):
        field.append(x.astype(x0.dtype))
    return jax.tree.unflatten(treedef, out), _state(rule, treedef, new, count)

  return optax.GradientTransformation(init_fn, update_fn)
