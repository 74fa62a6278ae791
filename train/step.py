"""One optimizer step and one evaluation, jitted on the mesh.

A step: gradients of the mean loss over ``accum`` micro-batches (a scan that sums them:
gradient accumulation when pp == 1; with pp > 1 the pipeline consumes the micro-batches
and ``accum`` is 1), clipping by the global norm, the optimizer's update, and a skip:
when the loss or the gradient is not finite, parameters and optimizer state come back
unchanged.

With Dion's compressed sync (rp > 1) its matrices' gradients carry a leading rp axis,
one gradient per replica; the gradient Dion applies is their mean, so the norm that
clipping and the log see is the mean's, and scaling every replica's gradient by the
same factor scales that mean.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import dion_jax
import models


class TrainState(NamedTuple):
  params: Any
  opt_state: Any
  updates: jax.Array  # optimizer updates applied so far (skipped steps excluded): the schedule's count


class StepMetrics(NamedTuple):
  loss: jax.Array
  grad_norm: jax.Array  # before clipping
  learning_rate: jax.Array
  skipped: jax.Array  # bool: the step changed nothing


def split_micro(batch: dict[str, jax.Array], accum: int) -> dict[str, jax.Array]:
  """[B, T] -> [accum, B / accum, T]; micro-batch i holds rows i, i + accum, ..., so each
  data-parallel shard splits its own rows and the batch sharding carries over."""

  def split(x_BxT):
    B, T = x_BxT.shape
    return x_BxT.reshape(B // accum, accum, T).swapaxes(0, 1)

  return jax.tree.map(split, batch)


def make_train_step(graphdef: Any, par: models.Parallelism, tx: optax.GradientTransformation,
                    lr_schedule: optax.Schedule, per_replica: Any | None, accum: int,
                    clip_grad: float) -> Callable[[TrainState, dict], tuple[TrainState, StepMetrics]]:
  def loss_fn(params, batch):
    return models.loss(graphdef, params, batch, par)

  if per_replica is None:
    grad_fn = jax.value_and_grad(loss_fn)
  else:
    grad_fn = dion_jax.value_and_grad_per_replica(loss_fn, par.mesh, per_replica)

  def mean_grads(params, batch):
    if accum == 1:
      return grad_fn(params, batch)
    micro = split_micro(batch, accum)

    def add(total, batch_i):
      return jax.tree.map(jnp.add, total, grad_fn(params, batch_i)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first))
    total, _ = jax.lax.scan(add, zeros, micro)
    return jax.tree.map(lambda x: x / accum, total)

  def applied_norm(grads):
    if per_replica is None:
      return optax.tree.norm(grads)
    return optax.tree.norm(jax.tree.map(lambda g, rep: g.mean(0) if rep else g, grads, per_replica))

  def step(state: TrainState, batch: dict) -> tuple[TrainState, StepMetrics]:
    loss, grads = mean_grads(state.params, batch)
    norm = applied_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    if clip_grad > 0:
      scale = jnp.minimum(1.0, clip_grad / jnp.maximum(norm, 1e-30))
      grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new = TrainState(jax.tree.map(keep, params, state.params),
                     jax.tree.map(keep, opt_state, state.opt_state),
                     state.updates + finite.astype(state.updates.dtype))
    return new, StepMetrics(loss, norm, lr_schedule(state.updates), ~finite)

  return jax.jit(step, donate_argnums=0)


def make_eval_step(graphdef: Any, par: models.Parallelism, accum: int) -> Callable[[Any, dict], jax.Array]:
  """Mean loss of a global batch, micro-batch by micro-batch like the train step."""

  def loss_fn(params, batch):
    if accum == 1:
      return models.loss(graphdef, params, batch, par)
    return jnp.mean(jax.lax.map(lambda b: models.loss(graphdef, params, b, par), split_micro(batch, accum)))

  return jax.jit(loss_fn)
