"""Shared cases of the mesh tests: a small GPT-like parameter set, its PartitionSpecs
(in Flax layout, stacked over pipeline stages and layers) and the meshes to try."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import dion_jax

D, V, STAGES, LAYERS = 32, 64, 2, 2
SHAPES = {
    "embed": (V, D),
    "qkv": (STAGES, LAYERS, D, 3 * D),
    "out": (STAGES, LAYERS, D, D),
    "fc1": (STAGES, LAYERS, D, 4 * D),
    "fc2": (STAGES, LAYERS, 4 * D, D),
    "norm": (STAGES, LAYERS, D),
    "lm_head": (D, V),
}
SPECS = {
    "embed": dion_jax.embedding(),
    "qkv": dion_jax.stacked(dion_jax.column_parallel(), 2),
    "out": dion_jax.stacked(dion_jax.row_parallel(), 2),
    "fc1": dion_jax.stacked(dion_jax.column_parallel(), 2),
    "fc2": dion_jax.stacked(dion_jax.row_parallel(), 2),
    "norm": P("pp", None, None),
    "lm_head": dion_jax.column_parallel(),
}
MESHES = ["rp=2,fs=2,tp=2", "fs=4,tp=2", "rp=8", "fs=2,tp=2,pp=2", "rp=2,fs=4"]


def params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def jitted_step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step
