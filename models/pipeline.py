"""A circular pipeline schedule over the mesh axis ``pp``, for use inside ``shard_map``.

Device ``j`` of ``pp`` holds ``virtual_stages`` stages: execution stage ``s = r·pp + j``
for repeat ``r``. Micro-batch ``i = g·pp + k`` (``k < pp``) is at stage ``s`` in
iteration

    t = g·pp·v + k + s,        v = virtual_stages,

which gives every device at most one (micro-batch, stage) per iteration, and makes each
stage's output the next stage's input one iteration later on the next device of the
ring: one ``ppermute`` j -> j+1 (mod pp) per iteration, point-to-point (NCCL send/recv
on GPUs). Device 0 takes a fresh micro-batch when ``r = 0`` and the ring's activation
otherwise. The schedule runs ``M·v + pp − 1`` iterations for ``M`` micro-batches, of which
each device computes a stage in ``M·v``: the bubble is ``(pp − 1)/(M·v + pp − 1)``
(GPipe's ``(pp − 1)/(M + pp − 1)`` when v = 1). Autodiff of the scan gives the backward
pass in reverse order, so the activations of all in-flight micro-batches are kept
(GPipe's memory; ``remat`` recomputes each layer's insides).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from models import fp8

AXIS = "pp"


def finish_iterations(num_micro: int, pp: int, virtual_stages: int) -> np.ndarray:
  """The iteration in which each micro-batch leaves the last stage (on device pp − 1)."""
  i = np.arange(num_micro)
  last_stage = pp * virtual_stages - 1
  return (i // pp) * pp * virtual_stages + i % pp + last_stage


def scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, n: int, unroll: bool = False,
         python_loop: bool = False) -> tuple[Any, Any]:
  """``jax.lax.scan(f, init, jnp.arange(n))``, or the same as a Python loop.

  The loop is for mixture-of-experts layers inside another ``shard_map`` (the pipeline's,
  Dion's per-replica gradient): jax 0.10 fails to lower their own ``shard_map``
  (``models/moe.py``) differentiated inside a scan there. It traces every iteration, so
  the compile time grows with their number.
  """
  if not python_loop:
    return jax.lax.scan(f, init, jnp.arange(n), unroll=unroll)
  carry, outs = init, []
  for i in range(n):
    carry, out = f(carry, jnp.int32(i))
    outs.append(out)
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def circular(stage_fn: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]], stage_params: Any,
             inputs_fn: Callable[[jax.Array], jax.Array], num_micro: int, pp: int,
             virtual_stages: int, unroll: bool = False, python_loop: bool = False) -> tuple[jax.Array, Any]:
  """Runs the schedule; returns the last stage's outputs ``[num_micro, ...]`` and every
  iteration's ``aux`` on this device ``[iterations, ...]`` (see :func:`iteration_repeats`).

  Delayed FP8's amax histories among a dict's ``stage_params`` (``models/fp8.py``) reach
  stage_fn as the parameters do, but their cotangent is the max of those of the
  iterations that ran a micro-batch (each its micro-batch's amaxes,
  :func:`models.fp8.repeated`), where a parameter's gradient is their sum.

  Args:
    stage_fn: ``stage_fn(params_of_one_stage, x, i) -> (y, aux)``, y of x's shape, where i
      is the micro-batch x belongs to (for what travels beside it, e.g. its segment ids);
      aux any pytree (None for none).
    stage_params: this device's stages, leaves ``[virtual_stages, ...]`` (repeat r at r).
    inputs_fn: ``inputs_fn(i) -> x``, micro-batch i's input to the first stage.
    num_micro: micro-batches M, a multiple of pp when virtual_stages > 1.
    pp, virtual_stages: the schedule's shape.
    unroll: unroll the loop over iterations.
    python_loop: run the iterations as a Python loop (:func:`scan`).

  Returns:
    The outputs in micro-batch order; meaningful on device pp − 1 only.
  """
  j = jax.lax.axis_index(AXIS)
  v = virtual_stages
  ring = [(a, (a + 1) % pp) for a in range(pp)]
  stage_params, histories = fp8.split_state(stage_params) if isinstance(stage_params, dict) else (stage_params, None)
  histories_I = None if histories is None else fp8.repeated(histories, iteration_repeats(num_micro, pp, v)[1])

  def iteration(state, t):
    u = t - j
    repeat = (u // pp) % v
    micro = jnp.clip((u // (pp * v)) * pp + u % pp, 0, num_micro - 1)
    x = jnp.where((j == 0) & (repeat == 0), inputs_fn(micro), state)
    stage = fp8.joined(jax.tree.map(lambda a: a[repeat], stage_params),
                       None if histories is None else jax.tree.map(lambda a: a[t, repeat], histories_I))
    y, aux = stage_fn(stage, x, micro)
    return jax.lax.ppermute(y, AXIS, ring), (y, aux)

  state = jnp.zeros_like(inputs_fn(0))
  if AXIS not in jax.typeof(state).manual_axis_type.varying:  # the ring's state differs per stage
    state = jax.lax.pcast(state, AXIS, to="varying")
  _, (ys, aux) = scan(iteration, state, num_micro * v + pp - 1, unroll, python_loop)
  return ys[finish_iterations(num_micro, pp, v)], aux


def iteration_repeats(num_micro: int, pp: int, virtual_stages: int) -> tuple[jax.Array, jax.Array]:
  """For each iteration of :func:`circular` on this device: the repeat (its stage among
  this device's ``virtual_stages``) and whether it ran a micro-batch (device j is busy
  in iterations [j, j + M·v)), both ``[iterations]``."""
  t = jnp.arange(num_micro * virtual_stages + pp - 1)
  u = t - jax.lax.axis_index(AXIS)
  return (u // pp) % virtual_stages, (u >= 0) & (u < num_micro * virtual_stages)


def scatter_from_last(outputs: jax.Array, pp: int) -> jax.Array:
  """Device d gets rows ``[d·M/pp, (d+1)·M/pp)`` of the last device's ``outputs`` [M, ...].

  ``pp − 1`` point-to-point sends from device pp − 1, so that the work after the
  pipeline (final norm, LM head, loss) is split over pp instead of repeated.
  """
  j = jax.lax.axis_index(AXIS)
  chunks = outputs.reshape(pp, outputs.shape[0] // pp, *outputs.shape[1:])
  mine = jnp.where(j == pp - 1, chunks[pp - 1], jnp.zeros_like(chunks[pp - 1]))
  for d in range(pp - 1):
    mine += jax.lax.ppermute(chunks[d], AXIS, [(pp - 1, d)])
  return mine
