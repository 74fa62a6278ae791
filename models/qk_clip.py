"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): keeps attention logits from growing past τ.

After each optimizer step, every attention head h whose largest pre-softmax logit S_h
in the step's forward pass (``models.loss(..., logit_max=True)``) exceeded τ has its
query and key kernels shrunk so that this logit would have been τ: γ_h = τ / S_h.
Without QK-norm the logits q·k/sqrt(H) are bilinear in the two kernels, so scaling the
head's query columns by a and its key columns by b scales all its logits by a·b, and
its largest one to τ when a·b = γ_h:

- multi-head attention (K = N): a = b = sqrt(γ_h), MuonClip's even split;
- grouped-query attention (K < N): a key head serves N/K query heads, so the whole
  factor goes to the query head (a = γ_h, b = 1) and the other heads of its group,
  clipped or not, keep their logits.

Heads at or under τ are untouched. With QK-norm the kernels' scale cancels in the
norm, so clipping them would change nothing: QK-clip needs ``qk_norm="none"`` (the
reference GPT's unscaled QK-norm bounds every logit by sqrt(H) already).

Kernels are [S, Ls, D, N·H] (query) and [S, Ls, D, K·H] (key), the maxima [S, Ls, N],
both in the blocks' stage layout, so the clip is elementwise on any mesh (and the same
with the group axes of ``moe_every``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.config import GPTConfig


def check(cfg: GPTConfig, threshold: float) -> None:
  """Raises ValueError for a threshold or a model that QK-clip cannot serve."""
  if not threshold > 0:
    raise ValueError(f"the QK-clip threshold must be a positive number, got {threshold!r}")
  if cfg.qk_norm != "none":
    raise ValueError(f"QK-clip scales the query and key kernels, which QK-norm ({cfg.qk_norm!r}) cancels:"
                     " it needs a model with qk_norm='none' (Llama-style)")


def qk_clip(params: Any, logits_SxLsxN: jax.Array, threshold: float, cfg: GPTConfig) -> tuple[Any, jax.Array]:
  """``(params, clipped)``: the parameters with the query and key kernels of every head
  whose logit maximum exceeds ``threshold`` scaled (module docstring), and the number of
  such heads (int32).

  With the layers in groups (``cfg.group_size`` > 1) the maxima are [S, Gs, moe_every, N]:
  the first moe_every − 1 of each group are its dense layers' (``blocks/dense``), the last
  its mixture-of-experts layer's (``blocks/moe``).
  """
  check(cfg, threshold)
  over = logits_SxLsxN > threshold
  gamma = jnp.where(over, threshold / jnp.where(over, logits_SxLsxN, 1.0), 1.0)
  blocks = params["blocks"]
  if cfg.group_size > 1:
    blocks = {"dense": _clipped(blocks["dense"], gamma[:, :, :-1], cfg),
              "moe": _clipped(blocks["moe"], gamma[:, :, -1], cfg)}
  else:
    blocks = _clipped(blocks, gamma, cfg)
  return {**params, "blocks": blocks}, jnp.sum(over).astype(jnp.int32)


def _clipped(layers: Any, gamma_LxN: jax.Array, cfg: GPTConfig) -> Any:
  """``layers`` (leaves [..., D, heads·H] behind the stack axes of ``gamma``'s [..., N]) with
  their query and key heads scaled by the factors ``gamma``."""
  grouped = cfg.kv_heads < cfg.num_heads
  query_factor, key_factor = (gamma_LxN, None) if grouped else (jnp.sqrt(gamma_LxN),) * 2

  def scaled(kernel, factor_LxN):
    heads = kernel.reshape(*kernel.shape[:-1], factor_LxN.shape[-1], cfg.head_dim)
    return (heads * factor_LxN[..., None, :, None].astype(kernel.dtype)).reshape(kernel.shape)

  attn = dict(layers["attn"])
  attn["query"] = {"kernel": scaled(attn["query"]["kernel"], query_factor)}
  if key_factor is not None:
    attn["key"] = {"kernel": scaled(attn["key"]["kernel"], key_factor)}
  return {**layers, "attn": attn}
