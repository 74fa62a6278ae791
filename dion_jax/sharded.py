"""Dion on parameters sharded over the (rp, fs, tp, pp) mesh, with ``shard_map``.

Each Dion parameter runs :func:`dion_jax.core.dion_matrix_step` on its local block
inside a ``shard_map`` whose specs are the parameter's own PartitionSpec, so no
device ever holds more than its shard of M, Q or the gradient. The reductions
follow the layout (DESIGN.md §3): with B's rows sharded over ``rows`` axes and its
columns over ``cols`` axes,

    P = B Q            psum over cols           (rows/tp x r)
    sketch S P, Gram   psum over rows           (k x r), (r x r)
    R = Bᵀ P           psum over rows           (cols/fs x r)
    ‖R‖_col            psum over cols           (r,)

and batch axes (layers, stages on ``pp``) never communicate. After the sum over
``cols``, every device of a column group holds the same P; when the local batch of
matrices (stacked layers) divides the group, the sum is a reduce-scatter along the
batch instead, each device orthonormalizes its share, and an all-gather restores P
(the reference does the same): the same bytes on the wire, 1/group of the work.

Data-parallel replicas (``rp``). With ``replicate_sync`` and rp > 1, Dion matrices
get their gradient per replica: a leading replica axis of size rp, sharded on
``rp`` (:func:`value_and_grad_per_replica` computes it). Then, per matrix:

- compressed sync, when ``(rows + cols)·r < rows·cols``: every replica keeps its
  own momentum (stored with the same leading replica axis) and only P and R are
  averaged over ``rp``: ``(rows + cols)·r`` values instead of ``rows·cols``. Since
  every step is linear in M, the parameters follow Dion on the averaged gradient
  exactly; the replicas' momenta differ but their mean is the single-device one.
- otherwise the gradient is averaged over ``rp`` first and the momentum is
  replicated like the parameter.
"""

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dion_jax import core
from dion_jax import frame as frame_lib
from dion_jax import mesh as mesh_lib

REPLICA_AXIS = "rp"


def _spec_entries(fr: frame_lib.MatrixFrame, axes) -> tuple:
  return tuple(fr.spec[a] for a in axes)


def _names(entries) -> tuple[str, ...]:
  out = []
  for e in entries:
    out += [] if e is None else list(e) if isinstance(e, (tuple, list)) else [e]
  return tuple(out)


def partition_specs_of(tree: Any) -> Any:
  """The PartitionSpec of every array of ``tree``, read from its ``NamedSharding``."""

  def spec(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      raise ValueError(
          f"cannot read a PartitionSpec from a {type(x).__name__} with sharding {sharding};"
          " pass partition_specs explicitly"
      )
    return sharding.spec

  return jax.tree.map(spec, tree)


class Layout:
  """How Dion's state and collectives lie on ``mesh`` (see the module docstring)."""

  def __init__(self, mesh: jax.sharding.Mesh, replicate_sync: bool, compress: bool = True):
    self.mesh = mesh
    self.replicas = dict(mesh.shape).get(REPLICA_AXIS, 1)
    self.per_replica = replicate_sync and self.replicas > 1
    self.compress = compress  # False for optimizers that need the whole gradient (Muon).

  def _checked(self, fr: frame_lib.MatrixFrame) -> frame_lib.MatrixFrame:
    if fr.spec is None:
      raise ValueError(
          "Dion on a mesh needs the parameters' PartitionSpecs: pass "
          "partition_specs=dion_jax.partition_specs_of(params) (or the model's spec tree)"
      )
    mesh_lib.check_divisible(fr.shape, fr.spec, self.mesh, fr.name)
    return fr

  def compressed(self, fr: frame_lib.MatrixFrame) -> bool:
    """Whether P and R are averaged over replicas instead of the gradient."""
    return self.compress and self.per_replica and (fr.rows + fr.cols) * fr.rank < fr.rows * fr.cols

  def param_struct(self, g: jax.Array) -> jax.ShapeDtypeStruct:
    """The parameter's shape, from its gradient (which may have a replica axis)."""
    return jax.ShapeDtypeStruct(g.shape[1:] if self.per_replica else g.shape, g.dtype)

  def momentum_spec(self, fr: frame_lib.MatrixFrame) -> P:
    spec = tuple(self._checked(fr).spec)
    return P(REPLICA_AXIS, *spec) if self.compressed(fr) else P(*spec)

  def grad_spec(self, fr: frame_lib.MatrixFrame) -> P:
    spec = tuple(self._checked(fr).spec)
    return P(REPLICA_AXIS, *spec) if self.per_replica else P(*spec)

  def q_spec(self, fr: frame_lib.MatrixFrame) -> P:
    fr = self._checked(fr)
    return P(*_spec_entries(fr, fr.batch_axes), fr.spec[fr.col_axis], None)

  def _constrain(self, x: jax.Array, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def init_momentum(self, fr: frame_lib.MatrixFrame, dtype) -> jax.Array:
    shape = ((self.replicas,) if self.compressed(fr) else ()) + fr.shape
    return self._constrain(jnp.zeros(shape, dtype), self.momentum_spec(fr))

  def constrain_q(self, fr: frame_lib.MatrixFrame, Q: jax.Array) -> jax.Array:
    return self._constrain(Q, self.q_spec(fr))

  def collectives(self, fr: frame_lib.MatrixFrame) -> core.Collectives:
    rows = _names([fr.spec[fr.row_axis]])
    cols = _names([fr.spec[fr.col_axis]])
    replica = (REPLICA_AXIS,) if self.compressed(fr) else ()
    return core.Collectives(
        rows=rows or None,
        cols=cols or None,
        replica=replica or None,
        everywhere=(rows + cols + replica) or None,
        spread=self._local_batch(fr) % self._size(cols + replica) == 0,
    )

  def _size(self, axes: tuple[str, ...]) -> int:
    return math.prod(dict(self.mesh.shape)[a] for a in axes)

  def _local_batch(self, fr: frame_lib.MatrixFrame) -> int:
    return math.prod(n // self._size(_names([fr.spec[a]])) for a, n in zip(fr.batch_axes, fr.batch_shape))

  def update(self, fr, M, g, Q, seed, use_cqr, scale, hp):
    """Sharded :func:`dion_jax.core.update_batched`; returns ``(M, Q, U)`` with U like the parameter."""
    compressed, per_replica = self.compressed(fr), self.per_replica
    axes = self.collectives(fr)

    def local(M, g, Q, seed, use_cqr):
      if per_replica:
        g = g[0] if compressed else jax.lax.pmean(g[0], REPLICA_AXIS)
      M, Q, U = core.update_batched(fr, M[0] if compressed else M, g, Q, seed, use_cqr, scale, hp, axes)
      return (M[None] if compressed else M), Q, U

    mspec, qspec = self.momentum_spec(fr), self.q_spec(fr)
    return jax.shard_map(
        local,
        mesh=self.mesh,
        in_specs=(mspec, self.grad_spec(fr), qspec, P(), P()),
        out_specs=(mspec, qspec, P(*fr.spec)),
    )(M, g, Q, seed, use_cqr)


def value_and_grad_per_replica(
    loss_fn: Callable[..., jax.Array],
    mesh: jax.sharding.Mesh,
    per_replica: Any,
    batch_spec: P = P(REPLICA_AXIS),
) -> Callable[..., tuple[jax.Array, Any]]:
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
  """

  def local(params, batch):
    # Marked as varying over rp: the gradient of a replicated input would be
    # summed over replicas by autodiff; we want each replica's own.
    params = jax.tree.map(lambda p: jax.lax.pcast(p, REPLICA_AXIS, to="varying"), params)
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = jax.tree.map(
        lambda g, keep: g[None] if keep else jax.lax.pmean(g, REPLICA_AXIS), grads, per_replica
    )
    return jax.lax.pmean(loss, REPLICA_AXIS), grads

  grad_specs = jax.tree.map(lambda keep: P(REPLICA_AXIS) if keep else P(), per_replica)

  def value_and_grad(params, batch):
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), batch_spec),
        out_specs=(P(), grad_specs),
        axis_names={REPLICA_AXIS},
    )(params, batch)

  return value_and_grad


def average_replicas(momentum: Any, replicas: int) -> Any:
  """Mean over a leading replica axis, broadcast to ``replicas`` copies (checkpoint
  restore onto another rp size: it preserves the trajectory, see the module docstring)."""
  return jax.tree.map(
      lambda m: jnp.broadcast_to(m.mean(0, keepdims=True), (replicas,) + m.shape[1:]).astype(m.dtype),
      momentum,
  )
