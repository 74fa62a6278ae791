"""Data-parallel replicas (``rp``) that keep their own gradient of some parameters.

Dion's compressed sync averages P and R over ``rp`` instead of the gradient
(``dion_jax.optimizers.dion``): for that, the gradients of its matrices must arrive
per replica, with a leading replica axis of size rp sharded on ``rp``. The other
gradients are averaged over ``rp`` once, after whatever the replica computes
(:func:`synced_over_replicas`: all its micro-batches, with gradient accumulation).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dion_jax.parallel.mesh import REPLICA_AXIS


def replica_spec(spec: P) -> P:
  """The spec of a per-replica array: a leading axis on ``rp``, then ``spec``."""
  return P(REPLICA_AXIS, *spec)


def value_and_grad_per_replica(
    loss_fn: Callable[..., jax.Array],
    mesh: jax.sharding.Mesh,
    per_replica: Any,
    batch_spec: P = P(REPLICA_AXIS),
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """``jax.value_and_grad(loss_fn)`` for compressed data-parallel sync.

  The returned function computes each rp replica's loss and gradient on its share
  of the batch (a ``shard_map`` manual over ``rp`` only; the other axes stay
  automatic). Leaves where ``per_replica`` is true (the Dion matrices; e.g.
  ``jax.tree.map(lambda l: l == "dion", labels)``) come back with a leading axis of
  size rp sharded on ``rp``, each replica's own gradient; the other leaves and the
  loss are averaged over ``rp``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    mesh: the mesh.
    per_replica: a pytree of bools matching ``params``.
    batch_spec: how the batch is split over ``rp`` (its leading axis by default).
    has_aux: ``loss_fn`` returns ``(loss, aux)``, as for ``jax.value_and_grad``; each
      replica's aux comes back stacked on a leading rp axis.
  """
  return synced_over_replicas(jax.value_and_grad(loss_fn, has_aux=has_aux), mesh, per_replica, batch_spec,
                              has_aux)


def synced_over_replicas(
    value_and_grad_fn: Callable[..., tuple[Any, Any]],
    mesh: jax.sharding.Mesh,
    per_replica: Any,
    batch_spec: P = P(REPLICA_AXIS),
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """``value_and_grad_fn`` run by each rp replica on its share of the batch, its
  gradients averaged over ``rp`` once, after it returns.

  ``value_and_grad_fn(params, batch) -> (value, grads)`` differentiates with respect
  to ``params``, which it receives marked as varying over rp: every gradient it takes
  is its replica's own, unreduced over rp. So a function that sums the gradients of
  several micro-batches reduces them over the replicas once per step, not once per
  micro-batch (DDP's ``no_sync`` during gradient accumulation); the other mesh axes
  stay automatic, and their reductions (fs's reduce-scatters) stay where the
  partitioner puts them. Outputs as :func:`value_and_grad_per_replica`'s: leaves where
  ``per_replica`` is true come back with a leading axis of size rp sharded on ``rp``,
  the other leaves and the value (the loss, without the aux) averaged over ``rp``;
  with ``has_aux``, the value is ``(loss, aux)`` and each replica's aux comes back
  stacked on a leading rp axis.
  """

  def local(params, batch):
    # Marked as varying over rp: the gradient of a replicated input would be
    # summed over replicas by autodiff; we want each replica's own.
    params = jax.tree.map(lambda p: jax.lax.pcast(p, REPLICA_AXIS, to="varying"), params)
    value, grads = value_and_grad_fn(params, batch)
    grads = jax.tree.map(
        lambda g, keep: g[None] if keep else jax.lax.pmean(g, REPLICA_AXIS), grads, per_replica
    )
    if has_aux:
      return (jax.lax.pmean(value[0], REPLICA_AXIS), jax.tree.map(lambda a: a[None], value[1])), grads
    return jax.lax.pmean(value, REPLICA_AXIS), grads

  grad_specs = jax.tree.map(lambda keep: P(REPLICA_AXIS) if keep else P(), per_replica)
  value_specs = (P(), P(REPLICA_AXIS)) if has_aux else P()

  def synced(params, batch):
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), batch_spec),
        out_specs=(value_specs, grad_specs),
        axis_names={REPLICA_AXIS},
    )(params, batch)

  return synced


def average_replicas(momentum: Any, replicas: int) -> Any:
  """Mean over a leading replica axis, broadcast to ``replicas`` copies: restoring a
  checkpoint onto another rp size keeps the trajectory, since every step is linear in
  the momentum and only the replicas' mean enters the update."""
  return jax.tree.map(
      lambda m: jnp.broadcast_to(m.mean(0, keepdims=True), (replicas,) + m.shape[1:]).astype(m.dtype),
      momentum,
  )
