"""One parameter's optimizer step inside ``shard_map``, over the parameter's own layout.

A matrix optimizer keeps per-parameter state (momentum, Dion's Q, NorMuon's second
moment) sharded like the parameter, and runs its step on each device's block: no
device ever holds more than its shard. :class:`Layout` is that placement for one mesh:
it checks a parameter's PartitionSpec against the mesh, places state at init, and
runs a local step in ``shard_map`` with the right specs.

Data-parallel replicas (``rp``). With ``replicate_sync`` and rp > 1 the optimizer's
gradients arrive per replica (a leading replica axis, see
``dion_jax.parallel.replicas``). A :class:`Placement` says, per parameter, whether the
local step takes this replica's own gradient (Dion's compressed sync, which then keeps
a momentum per replica) or the replicas' average.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dion_jax.parallel.mesh import REPLICA_AXIS, check_divisible
from dion_jax.parallel.replicas import replica_spec


class Placement(NamedTuple):
  """How one parameter's state lies on the mesh and which gradient its step takes.

  Attributes:
    param: the parameter's PartitionSpec (also the update's).
    state: the PartitionSpec of each state array, without the replica axis.
    state_per_replica: per state array, whether it holds one copy per replica
      (a leading replica axis on ``rp``).
    own_gradient: the step takes this replica's own gradient; else their average.
  """

  param: P
  state: tuple[P, ...]
  state_per_replica: tuple[bool, ...]
  own_gradient: bool = False


class Layout:
  """Placement and sharded execution of per-parameter optimizer steps on ``mesh``."""

  def __init__(self, mesh: jax.sharding.Mesh, replicate_sync: bool):
    self.mesh = mesh
    self.replicas = dict(mesh.shape).get(REPLICA_AXIS, 1)
    self.per_replica = replicate_sync and self.replicas > 1

  def check(self, shape: Sequence[int], spec: P | None, name: str) -> P:
    """``spec``, after checking that it exists and divides ``shape`` on the mesh."""
    if spec is None:
      raise ValueError(
          "a matrix optimizer on a mesh needs the parameters' PartitionSpecs: pass "
          "partition_specs=dion_jax.partition_specs_of(params) (or the model's spec tree)")
    check_divisible(shape, spec, self.mesh, name)
    return spec

  def size(self, axes: Sequence[str]) -> int:
    """Devices along ``axes`` of the mesh."""
    return math.prod(dict(self.mesh.shape)[a] for a in axes)

  def constrain(self, x: jax.Array, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def param_struct(self, g: jax.Array) -> jax.ShapeDtypeStruct:
    """The parameter's shape, from its gradient (which may have a replica axis)."""
    return jax.ShapeDtypeStruct(g.shape[1:] if self.per_replica else g.shape, g.dtype)

  def grad_spec(self, spec: P) -> P:
    return replica_spec(spec) if self.per_replica else spec

  def state_specs(self, placement: Placement) -> tuple[P, ...]:
    return tuple(replica_spec(s) if r else s for s, r in zip(placement.state, placement.state_per_replica))

  def place(self, placement: Placement, state: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Initial state arrays (the parameter's frame) on the mesh: a copy per replica
    where the placement asks for one."""
    per_replica = [jax.numpy.broadcast_to(x, (self.replicas,) + x.shape) if r else x
                   for x, r in zip(state, placement.state_per_replica)]
    return tuple(self.constrain(x, s) for x, s in zip(per_replica, self.state_specs(placement)))

  def run(self, local: Callable[..., tuple], placement: Placement, g: jax.Array,
          state: Sequence[jax.Array], args: Sequence[Any] = ()) -> tuple:
    """``local(g, *state, *args) -> (update, *state)`` on every device's block.

    ``args`` are replicated (scalars such as a step's seed). Returns the update
    (laid out like the parameter) and the new state, laid out as it came in.
    """
    per_replica, own = self.per_replica, placement.own_gradient
    flags = placement.state_per_replica
    n = len(state)

    def body(g, *rest):
      state, args = rest[:n], rest[n:]
      if per_replica:
        g = g[0] if own else jax.lax.pmean(g[0], REPLICA_AXIS)
      state = [x[0] if r else x for x, r in zip(state, flags)]
      update, *state = local(g, *state, *args)
      return (update, *(x[None] if r else x for x, r in zip(state, flags)))

    specs = self.state_specs(placement)
    return jax.shard_map(
        body,
        mesh=self.mesh,
        in_specs=(self.grad_spec(placement.param), *specs, *(P() for _ in args)),
        out_specs=(placement.param, *specs),
    )(g, *state, *args)
