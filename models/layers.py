"""The GPT's basic layers: a bias-free Dense kernel, the dense MLP, an RMS norm."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import GPTConfig
from models.sharding import Parallelism


def init_std(fan_in: int, fan_out: int) -> float:
  """σ = min(1, sqrt(fan_out/fan_in)) / sqrt(fan_in) (arXiv 2310.17813, as the reference)."""
  return min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class Dense(nnx.Module):
  """A bias-free kernel (fan_in, fan_out), column- or row-parallel.

  Initialized N(0, σ²), σ = :func:`init_std`.
  """

  def __init__(self, fan_in: int, fan_out: int, layout: str, *, rngs: nnx.Rngs):
    self.kernel = nnx.Param(init_std(fan_in, fan_out) * jax.random.normal(rngs.params(), (fan_in, fan_out), jnp.float32))
    self.layout = layout

  def __call__(self, x: jax.Array, par: Parallelism) -> jax.Array:
    return x @ par.weight(self.kernel[...], self.layout).astype(x.dtype)


class MLP(nnx.Module):
  """Column-parallel up (and gate), ReLU² (or SwiGLU: silu(gate)·up), row-parallel down;
  ``width`` hidden units (default ``cfg.d_mlp``)."""

  def __init__(self, cfg: GPTConfig, width: int | None = None, *, rngs: nnx.Rngs):
    F = cfg.d_mlp if width is None else width
    if cfg.mlp == "swiglu":
      self.gate = Dense(cfg.d_model, F, "column", rngs=rngs)
    self.up = Dense(cfg.d_model, F, "column", rngs=rngs)
    self.down = Dense(F, cfg.d_model, "row", rngs=rngs)
    self.kind = cfg.mlp

  def __call__(self, x_BxTxD: jax.Array, par: Parallelism) -> jax.Array:
    h_BxTxF = par.constrain(self.up(x_BxTxD, par), "batch", None, "mlp")
    if self.kind == "swiglu":
      g_BxTxF = par.constrain(self.gate(x_BxTxD, par), "batch", None, "mlp")
      return self.down(jax.nn.silu(g_BxTxF) * h_BxTxF, par)
    return self.down(jnp.square(jax.nn.relu(h_BxTxF)), par)
