"""Timing on a shared machine: medians, interleaved rounds, and a trainer's chained steps.

``python -m train.gpu`` (the GPU evidence) and the repository's benchmarks time with these.
"""
from __future__ import annotations

import functools
import statistics
import time

import jax
import optax


def _call(fn, args) -> None:
  jax.block_until_ready(fn(*args))


def time_fn(fn, args, repeats: int, warmup: int = 1) -> float:
  """Median wall time of ``fn(*args)`` in seconds over ``repeats`` calls after ``warmup`` calls."""
  for _ in range(warmup):
    _call(fn, args)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _call(fn, args)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def interleaved_times(cases: dict, rounds: int, repeats: int) -> dict[str, float]:
  """Median over ``rounds`` of each case's median time, the cases taking turns.

  The machines here are shared: their speed drifts by ±10% over seconds. Timing
  every case in every round, the plain matmul included, makes the ratios between
  cases (what the table reports) robust to that drift.
  """
  for fn, args in cases.values():
    for _ in range(2):  # Compile and warm up.
      _call(fn, args)
  per_round = {name: [] for name in cases}
  for _ in range(rounds):
    for name, (fn, args) in cases.items():
      per_round[name].append(time_fn(fn, args, repeats, warmup=0))
  return {name: statistics.median(ts) for name, ts in per_round.items()}


def throughput_time(fn, args, steps: int, warmup: int = 1, wait=jax.block_until_ready) -> float:
  """Mean seconds per call over ``steps`` chained calls ``args = fn(*args)``, one wait at the end.

  This is how a trainer runs its steps: the host queues the next step while the
  device works, so host overhead that overlaps with device time costs nothing. ``fn``
  returns its next arguments (a step that donates its state hands on the new one).
  ``warmup`` calls first compile and warm up. ``wait(args)`` returns when the device is
  done (PyTorch: ``torch.cuda.synchronize``).
  """
  for _ in range(warmup):
    args = fn(*args)
  wait(args)
  start = time.perf_counter()
  for _ in range(steps):
    args = fn(*args)
  wait(args)
  return (time.perf_counter() - start) / steps


def jitted_step(tx, params):
  """A jitted update + apply, its arguments, and the optimizer state's bytes."""
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape, p.dtype) * 1e-2, params)
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  return step, (params, state, grads), state_bytes



def donated_update(tx, grads):
  """``(params, state) -> (params, state)``: ``tx``'s update and apply with ``grads`` fixed,
  jitted with the parameters and state donated, as a trainer's step hands both on (for
  :func:`throughput_time`)."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return lambda params, state: update(params, state, grads)
