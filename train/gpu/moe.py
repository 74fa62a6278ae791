"""The ``moe`` stage of ``python -m train.gpu``: grouped matmuls against a dense one.

A mixture of experts multiplies each expert's rows by that expert's weights:
``jax.lax.ragged_dot`` on rows sorted by expert (``models/moe.py``). This stage checks it
against a per-expert loop, then times it, forward and backward in bfloat16, against one
dense matmul of the same rows and flops: what the experts would cost if grouping were
free. E = 8 and 64 experts, each with even groups and with a skewed split (half of the
rows to expert 0, the rest even), at the sizes of :data:`SHAPES`.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from train.gpu.timing import time_fn

# rows (tokens · top-k), d_model, expert width
SHAPES = ((32768, 1024, 1024), (32768, 2048, 2048))
EXPERTS = (8, 64)


def group_sizes(rows: int, experts: int, skewed: bool) -> np.ndarray:
  """Rows per expert, summing to ``rows``: even, or half of them to expert 0."""
  first = rows // 2 if skewed else rows // experts
  rest = (rows - first) // (experts - 1)
  sizes = np.full(experts, rest, np.int32)
  sizes[0] = rows - rest * (experts - 1)
  return sizes


def _loss(grouped: bool):
  def loss(x_RxD, w_ExDxF, sizes_E):
    y_RxF = jax.lax.ragged_dot(x_RxD, w_ExDxF, sizes_E) if grouped else x_RxD @ w_ExDxF[0]
    return jnp.sum(y_RxF, dtype=jnp.float32)

  return loss


def _per_expert(x_RxD, w_ExDxF, sizes_E) -> np.ndarray:
  """The grouped product as a loop over experts, in float32."""
  bounds = np.concatenate([[0], np.cumsum(sizes_E)])
  x, w = np.asarray(x_RxD, np.float32), np.asarray(w_ExDxF, np.float32)
  return np.concatenate([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])


def stage_moe(args, shapes=SHAPES, experts=EXPERTS) -> dict:
  rows, deadline = [], time.monotonic() + args.stage_seconds
  keys = iter(jax.random.split(jax.random.key(0), 64))
  grads = {kind: jax.jit(jax.grad(_loss(kind == "grouped"), argnums=(0, 1))) for kind in ("grouped", "dense")}
  forward = jax.jit(jax.lax.ragged_dot)
  for R, D, F in shapes:
    x = (jax.random.normal(next(keys), (R, D), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)
    dense_w = jax.random.normal(next(keys), (1, D, F), jnp.bfloat16)
    dense = time_fn(grads["dense"], (x, dense_w, jnp.array([R], jnp.int32)), repeats=9, warmup=2)
    for E in experts:
      w = jax.random.normal(next(keys), (E, D, F), jnp.bfloat16)
      for skewed in (False, True):
        if time.monotonic() > deadline:
          return {"rows": rows, "complete": False}
        sizes = group_sizes(R, E, skewed)
        want = _per_expert(x, w, sizes)
        got = np.asarray(forward(x, w, jnp.asarray(sizes)), np.float32)
        error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        t = time_fn(grads["grouped"], (x, w, jnp.asarray(sizes)), repeats=9, warmup=2)
        row = {"rows": R, "d_model": D, "d_expert": F, "experts": E, "skewed": skewed,
               "max_relative_error": error, "grouped_ms": t * 1e3, "dense_ms": dense * 1e3,
               "dense_over_grouped": dense / t, "grouped_tflops": 3 * 2 * R * D * F / t / 1e12}
        rows.append(row)
        print(f"  {R}x{D}x{F}, E={E}{' skewed' if skewed else ''}: grouped {t * 1e3:.2f} ms,"
              f" dense {dense * 1e3:.2f} ms ({dense / t:.2f}x), {row['grouped_tflops']:.0f} TFLOP/s,"
              f" error {error:.1e}", flush=True)
  return {"rows": rows, "complete": True}
