"""What one optimizer update moves and holds on a mesh, read from the compiled program.

For any optax transformation whose ``init`` places its state with sharding
constraints (the matrix optimizers of ``dion_jax`` do): the state's shardings are
those of the compiled ``init``, the update is compiled on abstract arrays (nothing
is allocated), and its collectives are counted by ``dion_jax.accounting.hlo``.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dion_jax.accounting.hlo import CollectiveStat, collective_stats
from dion_jax.parallel.mesh import REPLICA_AXIS
from dion_jax.parallel.replicas import replica_spec


def abstract_params(shapes: dict[str, tuple[int, ...]], specs: dict[str, P], mesh: jax.sharding.Mesh,
                    dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  """Abstract arrays of ``shapes``, each sharded by its PartitionSpec on ``mesh``."""
  return {k: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, specs[k])) for k, s in shapes.items()}


def abstract_state(tx: optax.GradientTransformation, params: Any) -> Any:
  """``tx.init(params)`` as abstract arrays with the shardings the compiled init gives them."""
  compiled = jax.jit(tx.init).lower(params).compile()
  shapes = jax.eval_shape(tx.init, params)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      shapes, compiled.output_shardings)


def update_stats(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh,
                 per_replica: bool = False) -> list[CollectiveStat]:
  """Collectives of one compiled ``tx.update``; with ``per_replica``, every gradient has
  a leading replica axis on ``rp`` (``dion_jax.value_and_grad_per_replica``)."""
  replicas = dict(mesh.shape).get(REPLICA_AXIS, 1)

  def gradient(p):
    if not per_replica:
      return p
    return jax.ShapeDtypeStruct((replicas,) + p.shape, p.dtype,
                                sharding=NamedSharding(mesh, replica_spec(p.sharding.spec)))

  grads = jax.tree.map(gradient, params)
  compiled = jax.jit(tx.update).lower(grads, abstract_state(tx, params)).compile()
  return collective_stats(compiled, mesh)


def state_bytes(state: Any) -> tuple[int, int]:
  """(bytes of ``state`` held by one device, bytes of all its arrays); arrays without a
  sharding count whole on every device."""
  leaves = jax.tree.leaves(state)
  shard = lambda x: x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape  # noqa: E731
  local = sum(x.dtype.itemsize * math.prod(shard(x)) for x in leaves)
  return local, sum(x.dtype.itemsize * math.prod(x.shape) for x in leaves)


def full_gradient_bytes(params: Any) -> int:
  """``Σ m·n·4``: the float32 payload of an all-reduce of every full gradient."""
  return sum(4 * math.prod(p.shape) for p in jax.tree.leaves(params))


def ring_allreduce_bytes(payload: int, group: int) -> int:
  """Bytes each of ``group`` devices sends in a ring all-reduce of ``payload`` bytes."""
  return 2 * payload * (group - 1) // group
