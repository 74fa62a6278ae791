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

On the model. Every aggregation is Σ w·ℓ with weights w of the mask alone
(:func:`token_weights`), so ``models.loss`` sums :func:`weighted`'s terms token by token in
training's forward, pipelined on pp and split on cp as the cross-entropy is: the
completions go in as :func:`sequence_batch`'s left-padded sequences, with the old and
reference log-probs (:func:`token_logps`, by the same forward), advantages and weights as
per-token fields (:func:`update_batch`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import models

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


def token_losses(logps_BxM: jax.Array, old_logps_BxM: jax.Array, advantages_BxM: jax.Array,
                 objective: Objective, ref_logps_BxM: jax.Array | None = None) -> tuple[jax.Array, LossStats]:
  """Each token's loss ℓ (module docstring) [B, M] and its statistics' terms: the k3 KL
  (0 when beta = 0) and whether the ratio was clipped below or above (1 or 0), [B, M].
  The advantages are per token (each completion's, repeated over its tokens)."""
  ratio_BxM = jnp.exp(logps_BxM - old_logps_BxM)
  clipped_BxM = jnp.clip(ratio_BxM, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
  loss_BxM = -jnp.minimum(ratio_BxM * advantages_BxM, clipped_BxM * advantages_BxM)
  kl_BxM = jnp.zeros_like(loss_BxM)
  if objective.beta != 0:
    log_ref_ratio_BxM = ref_logps_BxM - logps_BxM
    kl_BxM = jnp.exp(log_ref_ratio_BxM) - log_ref_ratio_BxM - 1
    loss_BxM = loss_BxM + objective.beta * kl_BxM
  clip_low_BxM = (ratio_BxM < 1 - objective.epsilon_low) & (advantages_BxM < 0)
  clip_high_BxM = (ratio_BxM > 1 + objective.epsilon_high) & (advantages_BxM > 0)
  return loss_BxM, LossStats(jax.lax.stop_gradient(kl_BxM), clip_low_BxM.astype(jnp.float32),
                             clip_high_BxM.astype(jnp.float32))


def token_weights(mask_BxM: jax.Array, objective: Objective, num_items: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """The aggregation as weights [B, M]: the loss is Σ w·ℓ (module docstring), and the
  statistics' token means Σ s·m / Σ m are Σ s·u with the second weights u = m / Σ m.
  They depend on the mask alone, so a sharded forward can sum w·ℓ token by token."""
  mask_BxM = mask_BxM.astype(jnp.float32)
  B = mask_BxM.shape[0]
  tokens = jnp.maximum(mask_BxM.sum(), 1.0)
  if objective.aggregation == "grpo":
    weights_BxM = mask_BxM / (B * jnp.maximum(mask_BxM.sum(-1, keepdims=True), 1.0))
  elif objective.aggregation == "bnpo":
    weights_BxM = mask_BxM / tokens
  elif objective.aggregation == "dr_grpo":
    weights_BxM = mask_BxM / (B * objective.max_completion_length)
  elif objective.aggregation == "dapo":
    weights_BxM = mask_BxM / (tokens if num_items is None else jnp.maximum(num_items, 1.0))
  else:
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {objective.aggregation!r}")
  return weights_BxM, mask_BxM / tokens


def weighted(objective: Objective, logps_BxM: jax.Array, fields: dict[str, jax.Array]
             ) -> tuple[jax.Array, LossStats]:
  """The terms w·ℓ [B, M] and the statistics' terms u·s of :func:`token_weights`, from
  ``fields``: "old", "advantages" (per token), "weights", "stat_weights", and "ref" when
  beta > 0 (``models.loss``'s ``objective``, as ``functools.partial(weighted, objective)``)."""
  loss_BxM, stats = token_losses(logps_BxM, fields["old"], fields["advantages"], objective, fields.get("ref"))
  return fields["weights"] * loss_BxM, LossStats(*(fields["stat_weights"] * s for s in stats))


def policy_loss(logps_BxM: jax.Array, old_logps_BxM: jax.Array, advantages_B: jax.Array, mask_BxM: jax.Array,
                objective: Objective, ref_logps_BxM: jax.Array | None = None,
                num_items: jax.Array | None = None) -> tuple[jax.Array, LossStats]:
  """The loss (module docstring) and its :class:`LossStats`. Log-probabilities [B, M] of
  each completion token under the policy (differentiated), the rollout's policy, and the
  reference (needed when beta > 0); ``mask_BxM`` 1 on the tokens that count."""
  weights_BxM, stat_weights_BxM = token_weights(mask_BxM, objective, num_items)
  fields = {"old": old_logps_BxM, "advantages": jnp.broadcast_to(advantages_B[:, None], logps_BxM.shape),
            "weights": weights_BxM, "stat_weights": stat_weights_BxM,
            **({"ref": ref_logps_BxM} if ref_logps_BxM is not None else {})}
  terms_BxM, stats = weighted(objective, logps_BxM, fields)
  return jnp.sum(terms_BxM), LossStats(*map(jnp.sum, stats))


def sequence_batch(tokens_BxT: jax.Array, pad_B: jax.Array, completion: int, multiple: int = 1
                   ) -> dict[str, jax.Array]:
  """``models.loss``'s batch of left-padded sequences [B, T] whose last ``completion``
  tokens count: inputs the tokens (right-padded with 0 to a multiple of ``multiple``, as
  cp's 2·cp chunks need), targets the next token at the T − completion − 1 … T − 2 that
  predict a completion token (-1 elsewhere), rotary positions from 0 at the first real
  token, the padding a segment of its own."""
  B, T = tokens_BxT.shape
  T_padded = -(-T // multiple) * multiple
  inputs_BxT = jnp.pad(jnp.asarray(tokens_BxT, jnp.int32), ((0, 0), (0, T_padded - T)))
  slots_BxT = jnp.arange(T_padded)[None, :] - jnp.asarray(pad_B)[:, None]
  predicts_T = (jnp.arange(T_padded) >= T - completion - 1) & (jnp.arange(T_padded) < T - 1)
  return {"inputs": inputs_BxT, "targets": jnp.where(predicts_T, jnp.roll(inputs_BxT, -1, 1), -1),
          "positions": jnp.maximum(slots_BxT, 0), "segment_ids": (slots_BxT >= 0).astype(jnp.int32)}


def token_logps(graphdef: Any, params: Any, tokens_BxT: jax.Array, pad_B: jax.Array, completion: int,
                temperature: float, par: models.Parallelism = models.Parallelism()) -> jax.Array:
  """log softmax(logits / ``temperature``) of the last ``completion`` tokens of left-padded
  sequences, float32 [B, completion], by the training forward on ``par``'s mesh
  (``models.token_logps``: pipelined on pp, split on cp); parameters laid out as there
  (blocks in stages)."""
  T = tokens_BxT.shape[1]
  batch = sequence_batch(tokens_BxT, pad_B, completion, 2 * par.cp)
  return models.token_logps(graphdef, params, batch, par, temperature)[:, T - completion - 1:T - 1]


def update_batch(tokens_BxT: jax.Array, pad_B: jax.Array, old_BxM: jax.Array, ref_BxM: jax.Array | None,
                 advantages_B: jax.Array, mask_BxM: jax.Array, objective: Objective,
                 num_items: jax.Array, cp: int = 1) -> dict[str, jax.Array]:
  """:func:`sequence_batch` with :func:`weighted`'s fields, each [B, M] value at
  the position that predicts its completion token (0 elsewhere)."""
  T, M = tokens_BxT.shape[1], old_BxM.shape[1]
  batch = sequence_batch(tokens_BxT, pad_B, M, 2 * cp)
  weights_BxM, stat_weights_BxM = token_weights(mask_BxM, objective, num_items)
  per_token = {"old": old_BxM, "advantages": jnp.broadcast_to(advantages_B[:, None], old_BxM.shape),
               "weights": weights_BxM, "stat_weights": stat_weights_BxM,
               **({"ref": ref_BxM} if ref_BxM is not None else {})}
  zeros_BxT = jnp.zeros(batch["inputs"].shape, jnp.float32)
  return {**batch, **{k: zeros_BxT.at[:, T - M - 1:T - 1].set(v) for k, v in per_token.items()}}
