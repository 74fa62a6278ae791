"""GRPO's objective: group-normalized advantages and the clipped policy-ratio loss with a
KL penalty, in the four token aggregations TRL names ``grpo``, ``bnpo``, ``dr_grpo`` and
``dapo`` (TRL's ``GRPOTrainer``, token-level importance sampling).

    adv_B = advantages(rewards_BxR, weights_R, group_size)       # rows grouped by prompt
    loss, stats = policy_loss(logps_BxM, old_BxM, adv_B, mask_BxM, Objective(beta=0.04))

Advantages. A completion's reward is the weighted sum of its reward functions' values,
r = Σ_j w_j r_j; within its group of G completions of one prompt A = r − mean(r), divided
by (std(r) + 1e-4) with ``scale_rewards`` (std with Bessel's correction, as TRL's nanstd).

Loss per completion token t (ρ = exp(logp − old_logp), the ratio to the rollout's policy):

    ℓ_t = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) + β·(exp(ref − logp) − (ref − logp) − 1)

the last term the k3 estimator of KL(π ‖ π_ref) (absent when β = 0). Aggregations over the
mask m (1 on completion tokens up to and including eos):

    grpo     mean over sequences of Σ_t m·ℓ / Σ_t m          (each sequence weighs the same)
    bnpo     Σ m·ℓ / Σ m                                       (each token of the batch the same)
    dr_grpo  Σ m·ℓ / (B · max_completion_length)               (a constant normalizer)
    dapo     Σ m·ℓ / num_items                                 (tokens of the whole rollout batch)

``num_items`` is the active tokens of the rollout batch the update belongs to (TRL's
``num_items_in_batch``); it equals Σ m when one update takes the whole rollout batch.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


class Objective(NamedTuple):
  """GRPO's loss settings (names as TRL's ``GRPOConfig``): clip range [1 − epsilon_low,
  1 + epsilon_high] (DAPO's clip-higher: epsilon_high > epsilon_low), KL weight beta,
  aggregation one of :data:`AGGREGATIONS`, max_completion_length for ``dr_grpo``."""
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  beta: float = 0.0
  aggregation: str = "dapo"
  max_completion_length: int = 256


class LossStats(NamedTuple):
  """Token means over the mask: the k3 KL (0 when beta = 0), and the share of tokens whose
  ratio was clipped below (ρ < 1 − ε_low with A < 0) or above (ρ > 1 + ε_high with A > 0)."""
  kl: jax.Array
  clip_low: jax.Array
  clip_high: jax.Array


def advantages(rewards_BxR: jax.Array, weights_R: jax.Array, group_size: int, scale_rewards: bool = True
               ) -> jax.Array:
  """Each completion's advantage [B] (module docstring); rows ``[i·G, (i+1)·G)`` are the
  completions of prompt i, G = ``group_size`` >= 2."""
  rewards_NxG = (rewards_BxR @ weights_R).reshape(-1, group_size)
  centered_NxG = rewards_NxG - rewards_NxG.mean(-1, keepdims=True)
  if scale_rewards:
    centered_NxG = centered_NxG / (jnp.std(rewards_NxG, -1, ddof=1, keepdims=True) + 1e-4)
  return centered_NxG.reshape(-1)


def policy_loss(logps_BxM: jax.Array, old_logps_BxM: jax.Array, advantages_B: jax.Array, mask_BxM: jax.Array,
                objective: Objective, ref_logps_BxM: jax.Array | None = None,
                num_items: jax.Array | None = None) -> tuple[jax.Array, LossStats]:
  """The loss (module docstring) and its :class:`LossStats`. Log-probabilities [B, M] of
  each completion token under the policy (differentiated), the rollout's policy, and the
  reference (needed when beta > 0); ``mask_BxM`` 1 on the tokens that count."""
  mask_BxM = mask_BxM.astype(jnp.float32)
  A_Bx1 = advantages_B[:, None]
  ratio_BxM = jnp.exp(logps_BxM - old_logps_BxM)
  clipped_BxM = jnp.clip(ratio_BxM, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
  loss_BxM = -jnp.minimum(ratio_BxM * A_Bx1, clipped_BxM * A_Bx1)
  tokens = jnp.maximum(mask_BxM.sum(), 1.0)
  kl = jnp.zeros(())
  if objective.beta != 0:
    log_ref_ratio_BxM = ref_logps_BxM - logps_BxM
    kl_BxM = jnp.exp(log_ref_ratio_BxM) - log_ref_ratio_BxM - 1
    loss_BxM = loss_BxM + objective.beta * kl_BxM
    kl = jnp.sum(kl_BxM * mask_BxM) / tokens
  masked_BxM = loss_BxM * mask_BxM
  if objective.aggregation == "grpo":
    loss = jnp.mean(masked_BxM.sum(-1) / jnp.maximum(mask_BxM.sum(-1), 1.0))
  elif objective.aggregation == "bnpo":
    loss = masked_BxM.sum() / tokens
  elif objective.aggregation == "dr_grpo":
    loss = masked_BxM.sum() / (logps_BxM.shape[0] * objective.max_completion_length)
  elif objective.aggregation == "dapo":
    loss = masked_BxM.sum() / (tokens if num_items is None else jnp.maximum(num_items, 1.0))
  else:
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {objective.aggregation!r}")
  clip_low = jnp.sum(((ratio_BxM < 1 - objective.epsilon_low) & (A_Bx1 < 0)) * mask_BxM) / tokens
  clip_high = jnp.sum(((ratio_BxM > 1 + objective.epsilon_high) & (A_Bx1 > 0)) * mask_BxM) / tokens
  return loss, LossStats(jax.lax.stop_gradient(kl), clip_low, clip_high)
