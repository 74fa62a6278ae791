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

Bounded megabatches (``megabatch_bytes``). Stacking copies a group's gradients and state
(b matrices' worth), and XLA, free to schedule the groups in any order, may run them side
by side (a GPU's scheduler overlaps independent work; measured on a CPU, XLA already ran
tiny's groups one at a time): the update's peak may hold every group's copy at once (on a
mesh, with Dion's ``split_q``, every group's gathered Q too), and always the largest
group's whole. With ``megabatch_bytes`` = N, each group is cut
along its stacking axis into chunks of c = max(1, floor(N / s)) parameters (s: one
parameter's gradient and state, bytes per device; the last chunk holds the rest), and the
chunks, all groups' in flatten order, run one after another: ``jax.lax.optimization_barrier``
ties chunk k+1's inputs to chunk k's outputs, a data dependence XLA's scheduler keeps,
so the peak holds one chunk's copy. Each matrix's step is its own (its momentum, its Q, the
step's shared seed), so the numbers are the unchunked ones; on a mesh a chunk's batch may no
longer divide a group that the whole batch did (Dion's spread P, Muon's padding to the
group), which changes only which collectives carry the same sums. The price is overlap:
one chunk's collectives no longer run beside another's computation.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dion_jax.optimizers.frame import MatrixView, scale_rule_fn
from dion_jax.parallel.layout import Layout, Placement
from dion_jax.parallel.mesh import axis_names

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
    megabatch_bytes: int | None = None,
) -> optax.GradientTransformation:
  """The optax transformation of ``rule`` (module docstring).

  With ``mesh``, every parameter's step runs inside ``shard_map`` over its own
  PartitionSpec (``dion_jax.parallel.layout``); gradients arrive per replica when
  ``replicate_sync`` and the mesh has rp > 1. ``megabatch_bytes``: None, every group at
  once; else chunks of at most this many bytes per device of stacked gradients and state
  (at least one parameter), stepped one after another (module docstring).
  """
  if megabatch_bytes is not None and (isinstance(megabatch_bytes, bool) or not isinstance(megabatch_bytes, int)
                                      or megabatch_bytes < 0):
    raise ValueError(f"megabatch_bytes must be None or an int >= 0 (bytes per device); got {megabatch_bytes!r}")
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

    def local_bytes(i):
      """One parameter's gradient and state, bytes per device."""
      xs = [leaves[i]] + [field[i] for field in old]
      if layout is None:
        return sum(x.nbytes for x in xs)
      placement = rule.placement(views[i], layout)
      specs = (layout.grad_spec(placement.param), *layout.state_specs(placement))
      return sum(x.nbytes // layout.size(axis_names(*spec)) for x, spec in zip(xs, specs))

    def step_chunk(chunk, g_leaves, state_leaves):
      """``chunk``'s parameters as one: (update, *state) per parameter."""
      if len(chunk) == 1:
        return [step(views[chunk[0]], g_leaves[0], [field[0] for field in state_leaves])]
      # A replica axis of the gradient or state, where there is one, stays in front of the
      # stacking axis; the update has none.
      g_axis = int(layout is not None and layout.per_replica)
      state_axes = [0] * len(old)
      if layout is not None:
        state_axes = [int(r) for r in rule.placement(views[chunk[0]], layout).state_per_replica]
      view = views[chunk[0]].stacked(len(chunk), ", ".join(views[i].frame.name for i in chunk))
      update, *stacked_new = step(view, jnp.stack(g_leaves, g_axis),
                                  [jnp.stack(field, a) for field, a in zip(state_leaves, state_axes)])
      # Static slices, not jnp.take's gathers: XLA fuses a slice into its consumer.
      return [(update[k], *(jax.lax.index_in_dim(x, k, a, keepdims=False) for x, a in zip(stacked_new, state_axes)))
              for k in range(len(chunk))]

    chunks = []
    for group in _groups(rule, views, leaves, old):
      size = len(group) if megabatch_bytes is None else max(1, megabatch_bytes // local_bytes(group[0]))
      chunks += [group[k:k + size] for k in range(0, len(group), size)]
    per_leaf, previous = [None] * len(leaves), None
    for chunk in chunks:
      inputs = ([leaves[i] for i in chunk], [[field[i] for i in chunk] for field in old])
      if megabatch_bytes is not None and previous is not None:
        # Chunk k+1 reads its inputs only after chunk k's outputs exist: one chunk's copy at a time.
        previous, inputs = jax.lax.optimization_barrier((previous, inputs))
        for i, result in previous.items():
          per_leaf[i] = result
      results = step_chunk(chunk, *inputs)
      previous = dict(zip(chunk, results))
      for i, result in previous.items():
        per_leaf[i] = result
    out, new = [], [[] for _ in rule.state_fields]
    for g, (update, *leaf_new), *leaf_state in zip(leaves, per_leaf, *old):
      out.append(update.astype(g.dtype))
      for field, x, x0 in zip(new, leaf_new, leaf_state):
        field.append(x.astype(x0.dtype))
    return jax.tree.unflatten(treedef, out), _state(rule, treedef, new, count)

  return optax.GradientTransformation(init_fn, update_fn)
