"""train/grpo/objective.py against TRL 1.16 itself: the loss, its gradient and its
statistics are what ``GRPOTrainer._compute_loss`` computes on the same inputs (TRL's own
code, called on a stand-in trainer whose model returns the given log-probabilities and
entropies) for every loss type, both importance sampling levels, with and without the KL
term (bias-corrected or not) and the high-entropy mask; the advantages are what
``GRPOTrainer._generate_and_score_completions`` makes of the same rewards (its own code,
on a stand-in trainer whose generation and reward functions return given values) for every
``scale_rewards`` and ``multi_objective_aggregation``. Inputs are random, with a
completion of every length, one of length 0 (a masked row) and ratios clipped both ways.
"""
import collections
import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import extras
from train.grpo import objective as grpo_objective

torch = pytest.importorskip("torch", reason=extras.TORCH)
trl = pytest.importorskip("trl", reason=extras.TRL)
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason=extras.TRL)
if trl.__version__ != "1.16.0":
  pytest.skip(f"the objectives are TRL 1.16.0's; trl {trl.__version__} is installed", allow_module_level=True)

G, PROMPTS, M = 4, 3, 7
B = G * PROMPTS
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def _inputs():
  rng = np.random.default_rng(0)
  logps = -rng.exponential(1.0, (B, M))
  old = logps + rng.normal(0, 0.3, (B, M))  # ratios well outside [0.8, 1.28]: clipping happens
  ref = logps + rng.normal(0, 0.5, (B, M))
  entropies = rng.exponential(1.0, (B, M)).astype(np.float32).astype(np.float64)  # the same ranks in both
  lengths = rng.integers(1, M + 1, B)
  lengths[0], lengths[1], lengths[5] = M, 1, 0  # row 5: fully masked
  mask = (np.arange(M)[None] < lengths[:, None]).astype(np.float64)
  advantages = rng.normal(0, 1, B)
  return logps, old, ref, entropies, mask, advantages


def _objective(loss_type: str = "dapo", level: str = "token", **settings) -> grpo_objective.Objective:
  """The objective of these inputs' clip range, KL weight and length, and ``settings``."""
  return grpo_objective.Objective(loss_type=loss_type, importance_sampling_level=level, epsilon_low=EPS_LOW,
                                  epsilon_high=settings.pop("epsilon_high", EPS_HIGH), beta=settings.pop("beta", BETA),
                                  max_completion_length=M, **settings)


def _stand_in(**settings):
  """A stand-in for a one-process GRPOTrainer on CPU with ``settings`` (TRL's attribute names)."""
  accelerator = types.SimpleNamespace(num_processes=1, process_index=0, device="cpu", sync_gradients=True,
                                      gather=lambda x: x, reduce=lambda x, reduction: x,
                                      gather_for_metrics=lambda x: x, pad_across_processes=lambda x, **_: x)
  args = {"use_bias_correction_kl": True, "delta": None, "steps_per_generation": 1,
          "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "gradient_accumulation_steps": 1,
          "per_device_train_batch_size": B, "gradient_checkpointing_kwargs": None}
  args.update(settings.pop("args", {}))
  attributes = dict(
      aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
      importance_sampling_level="token", beta=0.0, loss_type="dapo", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
      use_vllm=False, model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
      current_gradient_accumulation_steps=1, max_completion_length=M, accelerator=accelerator,
      _entropy_bonus_enabled=False, entropy_coef=0.0, use_adaptive_entropy=False, _last_world_entropy=math.inf,
      _entropy_window_stats=None, _metrics={"train": collections.defaultdict(list)},
      args=types.SimpleNamespace(**args))
  trainer = types.SimpleNamespace(**{**attributes, **settings})
  trainer.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, trainer)
  trainer.get_off_policy_mask = trl_grpo.GRPOTrainer.get_off_policy_mask
  trainer.get_gamma_weights = trl_grpo.GRPOTrainer.get_gamma_weights
  return trainer


# Objective's settings that are a GRPOTrainer's attributes; the others are its args'.
_ATTRIBUTES = ("beta", "loss_type", "importance_sampling_level", "epsilon_low", "epsilon_high",
               "off_policy_mask_threshold", "entropy_coef", "use_adaptive_entropy")
_ARGS = ("use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "delta", "vespo_k_pos",
         "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef_min", "entropy_coef_max",
         "entropy_coef_delta", "entropy_target")


def _trl_trainer(objective: grpo_objective.Objective, quantile: float = 1.0):
  """The stand-in trainer TRL would build from ``objective``'s settings."""
  return _stand_in(**{k: getattr(objective, k) for k in _ATTRIBUTES}, top_entropy_quantile=quantile,
                   _entropy_bonus_enabled=objective.entropy_bonus, args={k: getattr(objective, k) for k in _ARGS})


def _trl_loss(trainer, logps, old, ref, entropies, mask, advantages, num_items):
  """TRL's _compute_loss on these inputs (float64): loss, d loss / d logps, d loss / d
  entropies, and its metrics of this call."""
  logps_t = torch.tensor(logps, requires_grad=True)
  entropies_t = torch.tensor(entropies, requires_grad=True)
  trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps_t, entropies_t, None)
  trainer._metrics = {"train": collections.defaultdict(list)}
  inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
            "completion_ids": torch.zeros(B, M, dtype=torch.long), "completion_mask": torch.tensor(mask),
            "advantages": torch.tensor(advantages), "old_per_token_logps": torch.tensor(old),
            "ref_per_token_logps": torch.tensor(ref), "num_items_in_batch": torch.tensor(num_items)}
  loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  entropies_grad = np.zeros_like(entropies) if entropies_t.grad is None else entropies_t.grad.numpy()
  return float(loss.detach()), logps_t.grad.numpy(), entropies_grad, trainer._metrics["train"]


def _ours(objective, logps, old, ref, entropies, mask, advantages, num_items, quantile=1.0, entropy_coef=0.0):
  """Our loss (float32), its gradients with respect to the log-probs and entropies, its stats."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  keep = None if quantile >= 1 else grpo_objective.high_entropy_mask(f32(entropies), f32(mask), quantile)

  def loss_fn(logps, entropies):
    return grpo_objective.policy_loss(logps, f32(old), f32(advantages), f32(mask), objective, f32(ref),
                                      jnp.float32(num_items), keep, entropies, entropy_coef)

  (loss, stats), grads = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(f32(logps), f32(entropies))
  return float(loss), *map(np.asarray, grads), stats


def _check(objective: grpo_objective.Objective, quantile: float = 1.0, inputs=None):
  """Ours (float32) against TRL's (float64) within 1e-6: loss, gradients (log-probs and
  entropies), statistics (achieved ~1e-7); returns the loss's relative error and the
  gradient's (largest difference over largest entry)."""
  logps, old, ref, entropies, mask, advantages = _inputs() if inputs is None else inputs
  num_items = mask.sum() * 2  # dapo/cispo/vespo's normalizer: the rollout's tokens (here twice this batch's)
  loss, grad, entropies_grad, stats = _ours(objective, logps, old, ref, entropies, mask, advantages, num_items,
                                            quantile, objective.entropy_coef)
  expected, expected_grad, expected_entropies_grad, metrics = _trl_loss(
      _trl_trainer(objective, quantile), logps, old, ref, entropies, mask, advantages, num_items)
  assert abs(loss - expected) < 1e-6, (loss, expected)
  np.testing.assert_allclose(grad, expected_grad, atol=1e-6, rtol=0)
  np.testing.assert_allclose(entropies_grad, expected_entropies_grad, atol=1e-6, rtol=0)
  assert np.abs(expected_grad).max() > 1e-3  # the comparison is of a real gradient
  if objective.beta:
    assert float(stats.kl) == pytest.approx(metrics["kl"][0], abs=1e-6)
  else:
    assert float(stats.kl) == 0
  if objective.entropy_bonus and quantile >= 1:  # TRL's metric is over the mask; the bonus's over its tokens
    assert float(stats.entropy) == pytest.approx(metrics["entropy"][0], abs=1e-6)
  if objective.loss_type == "cispo":
    assert float(stats.clip_high) == pytest.approx(metrics["cispo_clip_ratio"][0], abs=1e-6)
    assert float(stats.clip_low) == 0
  elif objective.loss_type == "vespo":
    assert float(stats.phi) == pytest.approx(metrics["vespo/phi_seq_mean"][0], abs=1e-6)
    assert float(stats.clip_low) == float(stats.clip_high) == 0
  elif objective.loss_type == "sapo":
    assert float(stats.clip_low) == float(stats.clip_high) == 0
  else:
    assert float(stats.clip_low) == pytest.approx(metrics["clip_ratio/low_mean"][0], abs=1e-6)
    assert float(stats.clip_high) == pytest.approx(metrics["clip_ratio/high_mean"][0], abs=1e-6)
    if objective.importance_sampling_level == "token" and objective.delta is None:
      assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0
  loss_error = abs(loss - expected) / abs(expected)
  grad_error = float(np.abs(grad - expected_grad).max() / np.abs(expected_grad).max())
  print(f"{objective.loss_type} {objective.importance_sampling_level} delta={objective.delta}"
        f" opsm={objective.off_policy_mask_threshold} entropy_coef={objective.entropy_coef} q={quantile}:"
        f" loss {loss:.6f}, relative error {loss_error:.1e}, gradient's {grad_error:.1e}")
  return loss


@pytest.mark.parametrize("level", grpo_objective.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", grpo_objective.LOSS_TYPES)
def test_loss_equals_trls(loss_type, level):
  """Every loss type at both importance sampling levels (sequence: GSPO), with the
  bias-corrected KL term (TRL's default); cispo with ScaleRL's cap 5.0 and 0.9 (the cap
  binds on some tokens either way at these ratios); vespo's φ averaged over sequences (the
  masked row's φ(1) = 1 included, as TRL's)."""
  for eps_high in ((5.0, 0.9) if loss_type == "cispo" else (EPS_HIGH,)):
    _check(_objective(loss_type, level, epsilon_high=eps_high))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_loss_without_kl_or_its_bias_correction_equals_trls(loss_type):
  _check(_objective(loss_type, beta=0.0))
  _check(_objective(loss_type, use_bias_correction_kl=False))


@pytest.mark.parametrize("quantile", [0.2, 0.0])
@pytest.mark.parametrize("level", grpo_objective.IMPORTANCE_SAMPLING_LEVELS)
def test_top_entropy_quantile_equals_trls(quantile, level):
  """The policy term on the top-ρ entropy tokens only (0.0: the highest alone); the mask
  equals TRL's get_high_entropy_mask and keeps some but not all completion tokens."""
  logps, old, ref, entropies, mask, advantages = _inputs()
  ours = grpo_objective.high_entropy_mask(jnp.asarray(entropies, jnp.float32), jnp.asarray(mask, jnp.float32),
                                          quantile)
  theirs = _stand_in().get_high_entropy_mask(torch.tensor(entropies), torch.tensor(mask), 1 - quantile)
  np.testing.assert_array_equal(np.asarray(ours) > 0, theirs.numpy())
  assert 1 <= theirs.sum() < mask.sum()
  _check(_objective("dapo", level), quantile)


@pytest.mark.parametrize("level", grpo_objective.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_delta_equals_trls(loss_type, level):
  """Two-sided clipping: δ = 1.5 (above 1 + ε_high, as recommended) and 1.1 (below: it
  caps positive advantages' ratios too); each changes the loss (it binds at these ratios;
  the sequences' mean ratios stay below 1.5)."""
  base = _objective(loss_type, level)
  unbounded = _check(base)
  for delta in ((1.5, 1.1) if level == "token" else (1.1,)):
    assert _check(dataclasses.replace(base, delta=delta)) != pytest.approx(unbounded, abs=1e-4)


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "sequence"), ("cispo", "token"),
                                              ("sapo", "token"), ("vespo", "token"), ("luspo", "sequence")])
def test_off_policy_mask_equals_trls(loss_type, level):
  """OPSM at a threshold that drops some, not all, of the completions of negative advantage
  (TRL's own get_off_policy_mask on the same inputs says which): rows 3 and 6 of negative
  advantage drift from the rollout's policy, by a mean of 0.23 and 0.04 a token."""
  logps, old, ref, entropies, mask, advantages = _inputs()
  old[[3, 6]] += 0.3
  kept = trl_grpo.GRPOTrainer.get_off_policy_mask(torch.tensor(advantages)[:, None], torch.tensor(logps),
                                                  torch.tensor(old), torch.tensor(mask), 0.05)
  assert (kept[:, 0] == 0).numpy().nonzero()[0].tolist() == [3]
  eps_high = 5.0 if loss_type == "cispo" else EPS_HIGH
  _check(_objective(loss_type, level, epsilon_high=eps_high, off_policy_mask_threshold=0.05),
         inputs=(logps, old, ref, entropies, mask, advantages))


@pytest.mark.parametrize("quantile", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus_equals_trls(loss_type, quantile):
  """A fixed entropy bonus: the loss less c times the mean entropy over the completion
  tokens (the high-entropy mask's with q < 1); its gradient with respect to the entropies
  is TRL's."""
  _check(_objective(loss_type, entropy_coef=0.05), quantile)


@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_adaptive_entropy_equals_trls(quantile):
  """Skywork-OR1's control over four updates on one TRL trainer: the first applies no bonus
  (no entropy measured yet), the coefficient rises after an update whose entropy is at
  most the target, the next applies it, it falls after one above the target, the next
  applies none; loss, gradients, coefficient and measured entropy are TRL's at each."""
  objective = _objective("dapo", entropy_coef=0.1, use_adaptive_entropy=True, entropy_coef_delta=0.03,
                         entropy_target=0.8)
  trainer = _trl_trainer(objective, quantile)
  control = grpo_objective.EntropyControl(objective.entropy_coef)
  logps, old, ref, entropies, mask, advantages = _inputs()
  applied = []
  for scale in (0.2, 0.3, 2.0, 1.0):  # entropies below, below, above the target, then whatever
    inputs = (logps, old, ref, entropies * scale, mask, advantages)
    applied.append(control.applied(objective))
    loss, grad, entropies_grad, stats = _ours(objective, *inputs, mask.sum(), quantile, applied[-1])
    expected, expected_grad, expected_entropies_grad, _ = _trl_loss(trainer, *inputs, mask.sum())
    assert abs(loss - expected) < 1e-6, (loss, expected)
    np.testing.assert_allclose(grad, expected_grad, atol=1e-6, rtol=0)
    np.testing.assert_allclose(entropies_grad, expected_entropies_grad, atol=1e-6, rtol=0)
    print(f"adaptive entropy q={quantile} coefficient {applied[-1]:.2f}: loss {loss:.6f}, relative error"
          f" {abs(loss / expected - 1):.1e}, gradient's {np.abs(grad - expected_grad).max() / np.abs(expected_grad).max():.1e}")
    control = control.after(float(stats.entropy), objective)
    assert control.coef == pytest.approx(trainer.entropy_coef, abs=1e-12)
    assert control.entropy == pytest.approx(trainer._last_world_entropy, abs=1e-6)
  assert applied == pytest.approx([0.0, 0.13, 0.16, 0.0])


def test_flag_choices_are_the_objectives():
  """train.run.flags (which may not import jax) spells the objective's choices again."""
  from train.run import flags
  assert flags.CHOICES["loss_type"] == grpo_objective.LOSS_TYPES
  assert flags.CHOICES["importance_sampling_level"] == grpo_objective.IMPORTANCE_SAMPLING_LEVELS
  assert flags.CHOICES["scale_rewards"] == grpo_objective.SCALE_REWARDS
  assert flags.CHOICES["multi_objective_aggregation"] == grpo_objective.MULTI_OBJECTIVE_AGGREGATIONS


def _trl_advantages(rewards_BxR, weights, scale_rewards, aggregation):
  """The advantages TRL's _generate_and_score_completions makes of these rewards."""
  prompts = [f"prompt {i // G}" for i in range(B)]
  trainer = _stand_in(
      environment_factories=None, tools=None, environments=None, rollout_func=None,
      _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
      eos_token_ids=[1], num_iterations=1, num_generations=G, multi_objective_aggregation=aggregation,
      scale_rewards=scale_rewards, reward_weights=torch.tensor(weights), log_multimodal=False,
      reward_func_names=[f"r{j}" for j in range(rewards_BxR.shape[1])], reward_funcs=[None] * rewards_BxR.shape[1],
      _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
             "extra": collections.defaultdict(list)}, _pending_extra_logs={}, _pending_metrics={})
  trainer._generate = lambda prompts: ([[2]] * B, [[3, 1]] * B, None, ["c"] * B, None, {}, None, None)
  trainer._calculate_rewards = lambda *a: torch.tensor(rewards_BxR)
  return trl_grpo.GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": p} for p in prompts])["advantages"]


@pytest.mark.parametrize("aggregation", grpo_objective.MULTI_OBJECTIVE_AGGREGATIONS)
@pytest.mark.parametrize("scale_rewards", grpo_objective.SCALE_REWARDS)
def test_advantages_equal_trls(scale_rewards, aggregation):
  """Two reward functions weighted 1 and 0.5; a group whose rewards are all equal gets
  advantages 0 (sum_then_normalize) as TRL's."""
  rng = np.random.default_rng(1)
  rewards_BxR = rng.integers(0, 3, (B, 2)).astype(np.float64)
  rewards_BxR[:G] = [1.0, 2.0]
  weights = np.asarray([1.0, 0.5])
  expected = _trl_advantages(rewards_BxR, weights, scale_rewards, aggregation).numpy()
  got = grpo_objective.advantages(jnp.asarray(rewards_BxR, jnp.float32), jnp.asarray(weights, jnp.float32), G,
                                  scale_rewards, aggregation)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)
  assert np.abs(expected).max() > 0.1
