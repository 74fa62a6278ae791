"""GRPO's objective as TRL 1.16's ``GRPOTrainer`` computes it: advantages from the rewards
(``scale_rewards``, ``multi_objective_aggregation``) and the policy loss of each
``loss_type`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo``,
``vespo``) with token- or sequence-level importance sampling (GSPO), two-sided clipping
(``delta``), the off-policy sequence mask (``off_policy_mask_threshold``), the high-entropy
token mask (``top_entropy_quantile``), a KL penalty and an entropy bonus (``entropy_coef``,
fixed or adaptive). Names and defaults are ``GRPOConfig``'s.

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

    grpo, bnpo, dr_grpo, dapo, luspo  ℓ_t = −min(min(ρ, δ)·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)
    cispo                             ℓ_t = −sg(min(ρ, ε_high))·A·logp       (sg: no gradient)
    sapo                              ℓ_t = −σ(τ(ρ − 1))·4/τ·A,  τ = τ_pos if A > 0 else τ_neg
    vespo                             ℓ_t = −sg(φ(w))·A·logp,  φ(w) = e^λ·w^k·e^(−λw)

δ (``delta``, INTELLECT-2's two-sided clip) is +∞ unless set. VESPO's w is the completion's
whole ratio exp(Σ_t (logp − old_logp)) (each token's log-ratio clamped to [−20, 20], the
sum to [log 1e-8, 20]), with (k, λ) = (``vespo_k_pos``, ``vespo_lambda_pos``) where A >= 0,
the ``_neg`` pair elsewhere (λ at least 1e-4); φ(1) = 1.

With ``off_policy_mask_threshold`` κ (DeepSeek-V3.2's OPSM) a completion of A < 0 whose mean
old_logp − logp over its tokens exceeds κ counts nothing. With ``top_entropy_quantile`` q < 1
the policy term counts only on the tokens whose entropy reaches the (1 − q) quantile of the
rollout's completion tokens' (:func:`high_entropy_mask`). Then β·k3 is added, k3 =
exp(ref − logp) − (ref − logp) − 1 the estimator of KL(π ‖ π_ref), times ρ (before δ) with
``use_bias_correction_kl`` (TRL's default). Aggregations over the mask m (1 on completion
tokens up to and including eos), B completions:

    grpo, sapo            mean over sequences of Σ_t m·ℓ / Σ_t m     (each sequence weighs the same)
    bnpo                  Σ m·ℓ / Σ m                                  (each token of the batch the same)
    dr_grpo               Σ m·ℓ / (B · max_completion_length)          (a constant normalizer)
    dapo, cispo, vespo    Σ m·ℓ / num_items                            (tokens of the whole rollout)
    luspo                 Σ m·ℓ / B                                    (each sequence by its length)

``num_items`` is the active tokens of the rollout the update belongs to (TRL's
``num_items_in_batch``); it equals Σ m when one update takes the whole rollout.

The entropy bonus subtracts c·Σ m'·H / Σ m' from the loss, H the policy's entropy at each
completion token and m' the mask (times the high-entropy mask where there is one), c =
``entropy_coef``; with ``use_adaptive_entropy`` (Skywork-OR1) c only applies while the
entropy the previous update measured is at most ``entropy_target``, and after each update
moves by ``entropy_coef_delta`` towards more bonus where that update's entropy was at most
the target, less elsewhere, within [``entropy_coef_min``, ``entropy_coef_max``]
(:class:`EntropyControl`).

On the model. Every aggregation is Σ w·ℓ with weights w of the mask alone
(:func:`token_weights`), so ``models.loss`` sums :func:`weighted`'s terms token by token in
training's forward, whatever the rows' layout (``train/grpo/batch.py``: completions packed
several to a row, or one to a row), pipelined on pp and split on cp as the cross-entropy is;
a completion's sums over its tokens (GSPO's mean ratio, OPSM, VESPO) go through each token's
completion index, ``fields["sequence"]`` (summed over cp too where cp splits the rows).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from train.grpo.config import ObjectiveConfig

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclasses.dataclass(frozen=True)
class Objective(ObjectiveConfig):
  """GRPO's loss settings (:class:`~train.grpo.config.ObjectiveConfig`'s: TRL's names and
  defaults; the module docstring has the formulas) and what the rollout fixes:
  ``max_completion_length`` (``dr_grpo``'s normalizer) and ``sequences``, the completions
  of the update (B: the range of ``fields["sequence"]``)."""
  max_completion_length: int = 256
  sequences: int = 0


class LossStats(NamedTuple):
  """Means over the completion tokens (TRL's metrics): the k3 KL (0 when beta = 0); the
  share whose ρ was clipped below (ρ < 1 − ε_low with A < 0) or above (ρ > 1 + ε_high with
  A > 0; for cispo ρ > ε_high with A > 0), 0 for sapo and vespo; the policy's entropy over
  the entropy bonus's tokens (0 without the bonus); VESPO's φ (0 for the others). With
  sequence-level importance sampling the clip shares are means over sequences, as TRL's,
  and so is φ."""
  kl: jax.Array
  clip_low: jax.Array
  clip_high: jax.Array
  entropy: jax.Array
  phi: jax.Array


class EntropyControl(NamedTuple):
  """The adaptive entropy bonus's state between updates (TRL's ``entropy_coef`` and
  ``_last_world_entropy``): the coefficient, and the entropy the last update measured
  (+∞ before the first)."""
  coef: float
  entropy: float = math.inf

  def applied(self, objective: Objective) -> float:
    """The coefficient the next update applies."""
    if objective.use_adaptive_entropy and not self.entropy <= objective.entropy_target:
      return 0.0
    return self.coef

  def after(self, entropy: float, objective: Objective) -> EntropyControl:
    """The state after an update that measured ``entropy`` (unchanged without adaptive control)."""
    if not objective.use_adaptive_entropy:
      return self
    if entropy <= objective.entropy_target:
      return EntropyControl(min(self.coef + objective.entropy_coef_delta, objective.entropy_coef_max), entropy)
    return EntropyControl(max(self.coef - objective.entropy_coef_delta, objective.entropy_coef_min), entropy)


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


def _sequence_sums(x_BxT: jax.Array, fields: dict[str, jax.Array], objective: Objective) -> jax.Array:
  """At each token the sum of ``x_BxT`` over its completion's tokens [B, T] (a token of no
  completion reads completion 0's); over cp too where a ``shard_map`` manual over cp
  splits the rows. Each completion lies within one row, so a micro-batch or replica holds
  all of its tokens."""
  sequence_BxT = fields["sequence"]
  sums_S = jax.ops.segment_sum(x_BxT.ravel(), sequence_BxT.ravel(), objective.sequences)
  if "cp" in jax.sharding.get_abstract_mesh().manual_axes:
    sums_S = jax.lax.psum(sums_S, "cp")
  return sums_S[jnp.maximum(sequence_BxT, 0)]


def _sequence_means(x_BxT: jax.Array, fields: dict[str, jax.Array], objective: Objective) -> jax.Array:
  """At each token the mean of ``x_BxT`` over its completion's masked tokens [B, T] (0 for none)."""
  mask_BxT = fields["mask"]
  return _sequence_sums(x_BxT * mask_BxT, fields, objective) / jnp.maximum(_sequence_sums(mask_BxT, fields, objective),
                                                                           1.0)


def _gamma_weights(log_ratio_BxT: jax.Array, fields: dict[str, jax.Array], objective: Objective) -> jax.Array:
  """VESPO's φ(w) of each token's completion [B, T], no gradient (module docstring; TRL's
  ``get_gamma_weights``)."""
  log_ratio_BxT = jax.lax.stop_gradient(log_ratio_BxT)
  lowest = math.log(1e-8)
  log_w_BxT = jnp.clip(_sequence_sums(jnp.clip(log_ratio_BxT, -20.0, 20.0) * fields["mask"], fields, objective),
                       lowest, 20.0)
  positive_BxT = fields["advantages"] >= 0
  k_BxT = jnp.where(positive_BxT, objective.vespo_k_pos, objective.vespo_k_neg)
  lambda_BxT = jnp.maximum(jnp.where(positive_BxT, objective.vespo_lambda_pos, objective.vespo_lambda_neg), 1e-4)
  phi_BxT = jnp.exp(lambda_BxT + k_BxT * log_w_BxT - lambda_BxT * jnp.exp(log_w_BxT))
  return jnp.nan_to_num(phi_BxT, nan=0.0, posinf=0.0, neginf=0.0)


def _off_policy_mask(logps_BxT: jax.Array, fields: dict[str, jax.Array], objective: Objective) -> jax.Array:
  """OPSM [B, T]: 0 on the completions of A < 0 whose mean old_logp − logp exceeds the
  threshold, 1 elsewhere (TRL's ``get_off_policy_mask``, the rollout's log-probs as the
  sampler's)."""
  drift_BxT = _sequence_means(fields["old"] - jax.lax.stop_gradient(logps_BxT), fields, objective)
  return ((fields["advantages"] >= 0) | (drift_BxT <= objective.off_policy_mask_threshold)).astype(jnp.float32)


def token_losses(logps_BxT: jax.Array, fields: dict[str, jax.Array], objective: Objective
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
  """Each token's loss ℓ (module docstring) [B, T] and its statistics' terms: the k3 KL,
  whether ρ was clipped below or above (1 or 0) and VESPO's φ, each [B, T]. ``fields``:
  "old", "advantages" (each completion's, over its tokens), "mask", "sequence"; "keep"
  (the high-entropy mask) when given, "ref" when beta > 0."""
  advantages_BxT = fields["advantages"]
  log_ratio_BxT = logps_BxT - fields["old"]
  if objective.importance_sampling_level == "sequence":
    ratio_BxT = jnp.exp(_sequence_means(log_ratio_BxT, fields, objective))
  else:
    ratio_BxT = jnp.exp(log_ratio_BxT)
  clip_low_BxT = clip_high_BxT = phi_BxT = jnp.zeros_like(logps_BxT)
  if objective.loss_type == "cispo":
    capped_BxT = jax.lax.stop_gradient(jnp.minimum(ratio_BxT, objective.epsilon_high))
    loss_BxT = -capped_BxT * advantages_BxT * logps_BxT
    clip_high_BxT = (ratio_BxT > objective.epsilon_high) & (advantages_BxT > 0)
  elif objective.loss_type == "sapo":
    tau_BxT = jnp.where(advantages_BxT > 0, objective.sapo_temperature_pos, objective.sapo_temperature_neg)
    loss_BxT = -jax.nn.sigmoid(tau_BxT * (ratio_BxT - 1)) * 4 / tau_BxT * advantages_BxT
  elif objective.loss_type == "vespo":
    phi_BxT = _gamma_weights(log_ratio_BxT, fields, objective)
    loss_BxT = -phi_BxT * advantages_BxT * logps_BxT
  else:
    clipped_BxT = jnp.clip(ratio_BxT, 1 - objective.epsilon_low, 1 + objective.epsilon_high)
    # δ bounds the ratio itself, for negative advantages too; the clip range's side is TRL's.
    bounded_BxT = ratio_BxT if objective.delta is None else jnp.minimum(ratio_BxT, objective.delta)
    loss_BxT = -jnp.minimum(bounded_BxT * advantages_BxT, clipped_BxT * advantages_BxT)
    clip_low_BxT = (bounded_BxT < 1 - objective.epsilon_low) & (advantages_BxT < 0)
    clip_high_BxT = (bounded_BxT > 1 + objective.epsilon_high) & (advantages_BxT > 0)
  if objective.off_policy_mask_threshold is not None:
    loss_BxT = loss_BxT * _off_policy_mask(logps_BxT, fields, objective)
  if "keep" in fields:
    loss_BxT = loss_BxT * fields["keep"]
  kl_BxT = jnp.zeros_like(loss_BxT)
  if objective.beta != 0:
    log_ref_ratio_BxT = fields["ref"] - logps_BxT
    kl_BxT = jnp.exp(log_ref_ratio_BxT) - log_ref_ratio_BxT - 1
    if objective.use_bias_correction_kl:
      kl_BxT = kl_BxT * ratio_BxT
    loss_BxT = loss_BxT + objective.beta * kl_BxT
  return loss_BxT, (jax.lax.stop_gradient(kl_BxT), clip_low_BxT.astype(jnp.float32),
                    clip_high_BxT.astype(jnp.float32), phi_BxT)


def token_weights(mask_BxM: jax.Array, objective: Objective, num_items: jax.Array | None = None,
                  keep_BxM: jax.Array | None = None) -> dict[str, jax.Array]:
  """The aggregation as weights [B, M] of completions laid one to a row: the loss is Σ w·ℓ
  ("weights", module docstring); the statistics' token means Σ s·m / Σ m are Σ s·u with
  u = m / Σ m ("stat_weights"); means over sequences (clip shares at the sequence level,
  φ) weigh each completion's first token 1/B ("sequence_weights"); with the entropy bonus,
  its mean's weights m' / Σ m' ("entropy_weights"). They depend on the masks alone, so a
  sharded forward can sum w·ℓ token by token."""
  mask_BxM = mask_BxM.astype(jnp.float32)
  B = mask_BxM.shape[0]
  tokens = jnp.maximum(mask_BxM.sum(), 1.0)
  if objective.loss_type in ("grpo", "sapo"):
    weights_BxM = mask_BxM / (B * jnp.maximum(mask_BxM.sum(-1, keepdims=True), 1.0))
  elif objective.loss_type == "bnpo":
    weights_BxM = mask_BxM / tokens
  elif objective.loss_type == "dr_grpo":
    weights_BxM = mask_BxM / (B * objective.max_completion_length)
  elif objective.loss_type in ("dapo", "cispo", "vespo"):
    weights_BxM = mask_BxM / (tokens if num_items is None else jnp.maximum(num_items, 1.0))
  elif objective.loss_type == "luspo":
    weights_BxM = mask_BxM / B
  else:
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {objective.loss_type!r}")
  first_BxM = jnp.zeros_like(mask_BxM).at[:, 0].set(1.0 / B)
  out = {"weights": weights_BxM, "stat_weights": mask_BxM / tokens, "sequence_weights": first_BxM}
  if objective.entropy_bonus:
    counted_BxM = mask_BxM if keep_BxM is None else mask_BxM * keep_BxM
    out["entropy_weights"] = counted_BxM / jnp.maximum(counted_BxM.sum(), 1.0)
  return out


def weighted(objective: Objective, logps_BxT: jax.Array, entropies_BxT: jax.Array, fields: dict[str, jax.Array]
             ) -> tuple[jax.Array, LossStats]:
  """The loss's terms [B, T] (w·ℓ, less the entropy bonus's) and the statistics' weighted
  terms, from ``fields`` (:func:`per_token_fields`'s; ``models.loss``'s ``objective``, as
  ``functools.partial(weighted, objective)``). With the entropy bonus "entropy_bonus" holds
  c times its weights (c the coefficient this update applies)."""
  loss_BxT, (kl_BxT, low_BxT, high_BxT, phi_BxT) = token_losses(logps_BxT, fields, objective)
  terms_BxT = fields["weights"] * loss_BxT
  entropy_BxT = jnp.zeros_like(terms_BxT)
  if objective.entropy_bonus:
    terms_BxT = terms_BxT - fields["entropy_bonus"] * entropies_BxT
    entropy_BxT = fields["entropy_weights"] * jax.lax.stop_gradient(entropies_BxT)
  clip_weights_BxT = fields["sequence_weights" if objective.importance_sampling_level == "sequence" else "stat_weights"]
  return terms_BxT, LossStats(fields["stat_weights"] * kl_BxT, clip_weights_BxT * low_BxT, clip_weights_BxT * high_BxT,
                              entropy_BxT, fields["sequence_weights"] * phi_BxT)


def per_token_fields(old_BxM: jax.Array, ref_BxM: jax.Array | None, advantages_B: jax.Array, mask_BxM: jax.Array,
           objective: Objective, num_items: jax.Array | None = None, keep_BxM: jax.Array | None = None,
           entropy_coef: float = 0.0) -> dict[str, jax.Array]:
  """:func:`weighted`'s per-token fields of completions laid one to a row, each [B, M]
  ("sequence": the row's index); ``entropy_coef`` the coefficient the update applies."""
  out = {"old": old_BxM, "advantages": jnp.broadcast_to(advantages_B[:, None], old_BxM.shape),
         "mask": mask_BxM.astype(jnp.float32),
         "sequence": jnp.broadcast_to(jnp.arange(old_BxM.shape[0], dtype=jnp.int32)[:, None], old_BxM.shape),
         **token_weights(mask_BxM, objective, num_items, keep_BxM)}
  if ref_BxM is not None:
    out["ref"] = ref_BxM
  if keep_BxM is not None:
    out["keep"] = keep_BxM
  if objective.entropy_bonus:
    out["entropy_bonus"] = entropy_coef * out["entropy_weights"]
  return out


def policy_loss(logps_BxM: jax.Array, old_logps_BxM: jax.Array, advantages_B: jax.Array, mask_BxM: jax.Array,
                objective: Objective, ref_logps_BxM: jax.Array | None = None,
                num_items: jax.Array | None = None, keep_BxM: jax.Array | None = None,
                entropies_BxM: jax.Array | None = None, entropy_coef: float = 0.0) -> tuple[jax.Array, LossStats]:
  """The loss (module docstring) and its :class:`LossStats`. Log-probabilities [B, M] of
  each completion token under the policy (differentiated), the rollout's policy, and the
  reference (needed when beta > 0); ``mask_BxM`` 1 on the tokens that count; ``keep_BxM``
  the high-entropy mask (:func:`high_entropy_mask`) or None; ``entropies_BxM`` the policy's
  entropies (differentiated; needed with the entropy bonus, whose coefficient this update
  is ``entropy_coef``)."""
  objective = dataclasses.replace(objective, sequences=logps_BxM.shape[0])
  per_token = per_token_fields(old_logps_BxM, ref_logps_BxM, advantages_B, mask_BxM, objective, num_items, keep_BxM,
                     entropy_coef)
  entropies_BxM = jnp.zeros_like(logps_BxM) if entropies_BxM is None else entropies_BxM
  terms_BxM, stats = weighted(objective, logps_BxM, entropies_BxM, per_token)
  return jnp.sum(terms_BxM), LossStats(*map(jnp.sum, stats))
