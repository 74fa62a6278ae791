"""GRPO's objective as TRL 1.16's ``GRPOTrainer`` computes it: advantages from the rewards
(``scale_rewards``, ``multi_objective_aggregation``) and the policy loss of each
``loss_type`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``) with token- or
sequence-level importance sampling (GSPO), the high-entropy token mask
(``top_entropy_quantile``) and a KL penalty. Names and defaults are ``GRPOConfig``'s.

    adv_B = advantages(rewards_BxR, weights_R, group_size)           # rows grouped by prompt
    loss, stats = policy_loss(logps_BxM, old_BxM, adv_B, mask_BxM, Objective(beta=0.04))

Advantages (r_j: reward function j's value, w_j its weight, G completions per prompt):

    sum_then_normalize   r = Σ_j w_j r_j;  A = r − mean_group(r), divided by std(r) + 1e-4 with
                         ``scale_rewards`` group (std within the group) or batch (std over the
                         rollout), undivided with none
    normalize_then_sum   r = Σ_j w_j (r_j − mean_group(r_j)) / (std_group(r_j) + 1e-4);
                         A = (r − mean(r)) / (std(r) + 1e-4) over the rollout (TRL's GDPO;
                         ``scale_rewards`` does not enter)

std with Bessel's correction, as TRL's ``nanstd``.

Loss per completion token t. The importance weight ρ is exp(logp − old_logp) per token
(``importance_sampling_level`` token), or exp of its mean over the completion's tokens for
every token of it (sequence: GSPO):

    grpo, bnpo, dr_grpo, dapo   ℓ_t = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)
    cispo                       ℓ_t = −sg(min(ρ, ε_high))·A·logp       (sg: no gradient)
    sapo                        ℓ_t = −σ(τ(ρ − 1))·4/τ·A,  τ = τ_pos if A > 0 else τ_neg

With ``top_entropy_quantile`` q < 1 the policy term counts only on the tokens whose
entropy reaches the (1 − q) quantile of the rollout's completion tokens'
(:func:`high_entropy_mask`). Then β·k3 is added, k3 = exp(ref − logp) − (ref − logp) − 1
the estimator of KL(π ‖ π_ref), times ρ with ``use_bias_correction_kl`` (TRL's default).
Aggregations over the mask m (1 on completion tokens up to and including eos):

    grpo, sapo     mean over sequences of Σ_t m·ℓ / Σ_t m          (each sequence weighs the same)
    bnpo           Σ m·ℓ / Σ m                                       (each token of the batch the same)
    dr_grpo        Σ m·ℓ / (B · max_completion_length)               (a constant normalizer)
    dapo, cispo    Σ m·ℓ / num_items                                 (tokens of the whole rollout)

``num_items`` is the active tokens of the rollout the update belongs to (TRL's
``num_items_in_batch``); it equals Σ m when one update takes the whole rollout.

On the model. Every aggregation is Σ w·ℓ with weights w of the mask alone
(:func:`token_weights`), so ``models.loss`` sums :func:`weighted`'s terms token by token in
training's forward, pipelined on pp and split on cp as the cross-entropy is (the sequence
level's mean over a completion is a row sum, summed over cp where cp splits the row):
the completions go in as :func:`sequence_batch`'s left-padded sequences, with the old and
reference log-probs (:func:`token_logps`, by the same forward), advantages, mask and
weights as per-token fields (:func:`update_batch`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import models

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class Objective(NamedTuple):
  """GRPO's loss settings (names and defaults as TRL's ``GRPOConfig``; the module
  docstring has the formulas): the clip range [1 − epsilon_low, 1 + epsilon_high] (cispo's
  cap on ρ: epsilon_high), the KL weight beta, the loss type, max_completion_length for
  ``dr_grpo``, the importance sampling level, SAPO's temperatures."""
  epsilon_low: float = 0.2
  epsilon_high: float = 0.2
  beta: float = 0.0
  loss_type: str = "dapo"
  max_completion_length: int = 256
  importance_sampling_level: str = "token"
  sapo_temperature_pos: float = 1.0
  sapo_temperature_neg: float = 1.05
  use_bias_correction_kl: bool = True


class LossStats(NamedTuple):
  """Means over the completion tokens (TRL's metrics): the k3 KL (0 when beta = 0); the
  share whose ρ was clipped below (ρ < 1 − ε_low with A < 0) or above (ρ > 1 + ε_high with
  A > 0; for cispo ρ > ε_high with A > 0), 0 for sapo. With sequence-level importance
  sampling the clip shares are means over sequences, as TRL's."""
  kl: jax.Array
  clip_low: jax.Array
  clip_high: jax.Array


def _nanstd(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
  return jnp.std(x, axis=axis, ddof=1, keepdims=keepdims)


def advantages(rewards_BxR: jax.Array, weights_R: jax.Array, group_size: int, scale_rewards: str = "group",
               multi_objective_aggregation: str = "sum_then_normalize") -> jax.Array:
  """Each completion's advantage [B] (module docstring); rows ``[i·G, (i+1)·G)`` are the
  completions of prompt i, G = ``group_size`` >= 2."""
  G = group_size
  if multi_objective_aggregation == "normalize_then_sum":
    grouped_NxGxR = rewards_BxR.reshape(-1, G, rewards_BxR.shape[-1])
    scaled_NxGxR = ((grouped_NxGxR - grouped_NxGxR.mean(1, keepdims=True))
                    / (_nanstd(grouped_NxGxR, 1, keepdims=True) + 1e-4))
    rewards_B = scaled_NxGxR.reshape(rewards_BxR.shape) @ weights_R
    return (rewards_B - rewards_B.mean()) / (_nanstd(rewards_B) + 1e-4)
  rewards_NxG = (rewards_BxR @ weights_R).reshape(-1, G)
  centered_NxG = rewards_NxG - rewards_NxG.mean(-1, keepdims=True)
  if scale_rewards == "group":
    centered_NxG = centered_NxG / (_nanstd(rewards_NxG, -1, keepdims=True) + 1e-4)
  elif scale_rewards == "batch":
    centered_NxG = centered_NxG / (_nanstd(rewards_NxG) + 1e-4)
  return centered_NxG.reshape(-1)


def high_entropy_mask(entropies_BxM: jax.Array, mask_BxM: jax.Array, quantile: float) -> jax.Array:
  """1 on the completion tokens (``mask_BxM``) whose entropy reaches the ``1 − quantile``
  quantile (linear interpolation, as torch.quantile) of all completion tokens' entropies,
  0 elsewhere [B, M] (TRL's ``get_high_entropy_mask``; ``top_entropy_quantile`` q)."""
  counted_BxM = mask_BxM > 0
  threshold = jnp.nanquantile(jnp.where(counted_BxM, entropies_BxM, jnp.nan), 1 - quantile)
  return (counted_BxM & (entropies_BxM * mask_BxM >= threshold)).astype(jnp.float32)


def _row_sum(x_BxT: jax.Array) -> jax.Array:
  """Each row's sum [B, 1], over cp too where a ``shard_map`` manual over cp splits the rows."""
  total_Bx1 = x_BxT.sum(-1, keepdims=True)
  if "cp" in jax.sharding.get_abstract_mesh().manual_axes:
    total_Bx1 = jax.lax.psum(total_Bx1, "cp")
  return total_Bx1


def token_losses(logps_BxM: jax.Array, fields: dict[str, jax.Array], objective: Objective
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """Each token's loss ℓ (module docstring) [B, M] and its statistics' terms: the k3 KL
  and whether ρ was clipped below or above (1 or 0), each [B, M]. ``fields``: "old",
  "advantages" (each completion's, repeated over its tokens), "mask"; "keep" (the
  high-entropy mask) when given, "ref" when beta > 0."""
  advantages_BxM, mask_BxM = fields["advantages"], fields["mask"]
  log_ratio_BxM = logps_BxM - fields["old"]
  if objective.importance_sampling_level == "sequence":
    log_ratio_BxM = jnp.broadcast_to(_row_sum(log_ratio_BxM * mask_BxM) / jnp.maximum(_row_sum(mask_BxM), 1.0),
                                     log_ratio_BxM.shape)
  ratio_BxM = jnp.exp(log_ratio_BxM)
  if objective.loss_type == "cispo":
    capped_BxM = jax.lax.stop_gradient(jnp.minimum(ratio_BxM, objective.epsilon_high))
    loss_BxM = -capped_BxM * advantages_BxM * logps_BxM
    clip_low_BxM = jnp.zeros_like(loss_BxM, bool)
    clip_high_BxM = (ratio_BxM > objective.epsilon_high) & (advantages_BxM > 0)
  elif objective.loss_type == "sapo":
    tau_BxM = jnp.where(advantages_BxM > 0, objective.sapo_temperature_pos, objective.sapo_temperature_neg)
    loss_BxM = -jax.nn.sigmoid(tau_BxM * (ratio_BxM - 1)) * 4 / tau_BxM * advantages_BxM
    clip_low_BxM = clip_high_BxM = jnp.zeros_like(loss_BxM, bool)
  else:
    clipped_BxM = jnp.clip(ratio_BxM, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
    loss_BxM = -jnp.minimum(ratio_BxM * advantages_BxM, clipped_BxM * advantages_BxM)
    clip_low_BxM = (ratio_BxM < 1 - objective.epsilon_low) & (advantages_BxM < 0)
    clip_high_BxM = (ratio_BxM > 1 + objective.epsilon_high) & (advantages_BxM > 0)
  if "keep" in fields:
    loss_BxM = loss_BxM * fields["keep"]
  kl_BxM = jnp.zeros_like(loss_BxM)
  if objective.beta != 0:
    log_ref_ratio_BxM = fields["ref"] - logps_BxM
    kl_BxM = jnp.exp(log_ref_ratio_BxM) - log_ref_ratio_BxM - 1
    if objective.use_bias_correction_kl:
      kl_BxM = kl_BxM * ratio_BxM
    loss_BxM = loss_BxM + objective.beta * kl_BxM
  return loss_BxM, (jax.lax.stop_gradient(kl_BxM), clip_low_BxM.astype(jnp.float32),
                    clip_high_BxM.astype(jnp.float32))


def token_weights(mask_BxM: jax.Array, objective: Objective, num_items: jax.Array | None = None
                  ) -> dict[str, jax.Array]:
  """The aggregation as weights [B, M]: the loss is Σ w·ℓ ("weights", module docstring);
  the statistics' token means Σ s·m / Σ m are Σ s·u with u = m / Σ m ("stat_weights"), the
  clip shares' means over sequences (sequence level) Σ s·m / (B·Σ_t m). They depend on the
  mask alone, so a sharded forward can sum w·ℓ token by token."""
  mask_BxM = mask_BxM.astype(jnp.float32)
  B = mask_BxM.shape[0]
  tokens = jnp.maximum(mask_BxM.sum(), 1.0)
  per_sequence_BxM = mask_BxM / (B * jnp.maximum(mask_BxM.sum(-1, keepdims=True), 1.0))
  if objective.loss_type in ("grpo", "sapo"):
    weights_BxM = per_sequence_BxM
  elif objective.loss_type == "bnpo":
    weights_BxM = mask_BxM / tokens
  elif objective.loss_type == "dr_grpo":
    weights_BxM = mask_BxM / (B * objective.max_completion_length)
  elif objective.loss_type in ("dapo", "cispo"):
    weights_BxM = mask_BxM / (tokens if num_items is None else jnp.maximum(num_items, 1.0))
  else:
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {objective.loss_type!r}")
  token_mean_BxM = mask_BxM / tokens
  clip_mean_BxM = per_sequence_BxM if objective.importance_sampling_level == "sequence" else token_mean_BxM
  return {"weights": weights_BxM, "stat_weights": token_mean_BxM, "clip_weights": clip_mean_BxM}


def weighted(objective: Objective, logps_BxM: jax.Array, fields: dict[str, jax.Array]
             ) -> tuple[jax.Array, LossStats]:
  """The terms w·ℓ [B, M] and the statistics' weighted terms of :func:`token_weights`,
  from ``fields`` (:func:`token_losses`'s and :func:`token_weights`'s;
  ``models.loss``'s ``objective``, as ``functools.partial(weighted, objective)``)."""
  loss_BxM, (kl_BxM, low_BxM, high_BxM) = token_losses(logps_BxM, fields, objective)
  return fields["weights"] * loss_BxM, LossStats(fields["stat_weights"] * kl_BxM, fields["clip_weights"] * low_BxM,
                                                 fields["clip_weights"] * high_BxM)


def _fields(old_BxM: jax.Array, ref_BxM: jax.Array | None, advantages_B: jax.Array, mask_BxM: jax.Array,
            keep_BxM: jax.Array | None, objective: Objective, num_items: jax.Array | None) -> dict[str, jax.Array]:
  """:func:`weighted`'s per-token fields, each [B, M]."""
  return {"old": old_BxM, "advantages": jnp.broadcast_to(advantages_B[:, None], old_BxM.shape),
          "mask": mask_BxM.astype(jnp.float32), **token_weights(mask_BxM, objective, num_items),
          **({"ref": ref_BxM} if ref_BxM is not None else {}), **({"keep": keep_BxM} if keep_BxM is not None else {})}


def policy_loss(logps_BxM: jax.Array, old_logps_BxM: jax.Array, advantages_B: jax.Array, mask_BxM: jax.Array,
                objective: Objective, ref_logps_BxM: jax.Array | None = None,
                num_items: jax.Array | None = None, keep_BxM: jax.Array | None = None
                ) -> tuple[jax.Array, LossStats]:
  """The loss (module docstring) and its :class:`LossStats`. Log-probabilities [B, M] of
  each completion token under the policy (differentiated), the rollout's policy, and the
  reference (needed when beta > 0); ``mask_BxM`` 1 on the tokens that count; ``keep_BxM``
  the high-entropy mask (:func:`high_entropy_mask`) or None."""
  fields = _fields(old_logps_BxM, ref_logps_BxM, advantages_B, mask_BxM, keep_BxM, objective, num_items)
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
                temperature: float, par: models.Parallelism = models.Parallelism(), entropy: bool = False
                ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """log softmax(logits / ``temperature``) of the last ``completion`` tokens of left-padded
  sequences, float32 [B, completion], by the training forward on ``par``'s mesh
  (``models.token_logps``: pipelined on pp, split on cp); parameters laid out as there
  (blocks in stages). With ``entropy`` also the entropy of each of those tokens'
  distributions [B, completion]."""
  T = tokens_BxT.shape[1]
  batch = sequence_batch(tokens_BxT, pad_B, completion, 2 * par.cp)
  out = models.token_logps(graphdef, params, batch, par, temperature, entropy=entropy)
  return jax.tree.map(lambda x_BxT: x_BxT[:, T - completion - 1:T - 1], out)


def update_batch(tokens_BxT: jax.Array, pad_B: jax.Array, old_BxM: jax.Array, ref_BxM: jax.Array | None,
                 advantages_B: jax.Array, mask_BxM: jax.Array, objective: Objective, num_items: jax.Array,
                 keep_BxM: jax.Array | None = None, cp: int = 1) -> dict[str, jax.Array]:
  """:func:`sequence_batch` with :func:`weighted`'s fields, each [B, M] value at the
  position that predicts its completion token (0 elsewhere)."""
  T, M = tokens_BxT.shape[1], old_BxM.shape[1]
  batch = sequence_batch(tokens_BxT, pad_B, M, 2 * cp)
  per_token = _fields(old_BxM, ref_BxM, advantages_B, mask_BxM, keep_BxM, objective, num_items)
  zeros_BxT = jnp.zeros(batch["inputs"].shape, jnp.float32)
  return {**batch, **{k: zeros_BxT.at[:, T - M - 1:T - 1].set(v) for k, v in per_token.items()}}
