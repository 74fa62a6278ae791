"""What every benchmark shares: timing (interleaved rounds, medians) and a jitted optimizer step.

Benchmarks run as scripts (``python benchmarks/NAME.py``) or modules
(``python -m benchmarks.NAME``) from the repository root and use public names only.
"""
from __future__ import annotations

import statistics
import time

import jax
import optax


def time_fn(fn, args, repeats: int) -> float:
  """Median wall time of ``fn(*args)`` in seconds over ``repeats`` calls."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
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
      jax.block_until_ready(fn(*args))
  per_round = {name: [] for name in cases}
  for _ in range(rounds):
    for name, (fn, args) in cases.items():
      per_round[name].append(time_fn(fn, args, repeats))
  return {name: statistics.median(ts) for name, ts in per_round.items()}


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
