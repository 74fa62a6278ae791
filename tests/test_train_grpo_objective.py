"""train/grpo_objective.py against TRL 1.16 itself: the loss, its gradient and its
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
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import extras
from train import grpo_objective

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
      _entropy_bonus_enabled=False, _metrics={"train": collections.defaultdict(list)},
      args=types.SimpleNamespace(**args))
  trainer = types.SimpleNamespace(**{**attributes, **settings})
  trainer.get_high_entropy_mask = types.MethodType(trl_grpo.GRPOTrainer.get_high_entropy_mask, trainer)
  return trainer


def _trl_loss(logps, old, ref, entropies, mask, advantages, num_items, **settings):
  """TRL's _compute_loss on these inputs (float64): loss, d loss / d logps, and its metrics."""
  logps_t = torch.tensor(logps, requires_grad=True)
  trainer = _stand_in(**settings)
  trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps_t, torch.tensor(entropies), None)
  inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
            "completion_ids": torch.zeros(B, M, dtype=torch.long), "completion_mask": torch.tensor(mask),
            "advantages": torch.tensor(advantages), "old_per_token_logps": torch.tensor(old),
            "ref_per_token_logps": torch.tensor(ref), "num_items_in_batch": torch.tensor(num_items)}
  loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  return float(loss.detach()), logps_t.grad.numpy(), trainer._metrics["train"]


def _check(objective: grpo_objective.Objective, quantile: float = 1.0):
  """Ours (float32) against TRL's (float64) within 1e-6: loss, gradient, statistics (achieved ~1e-7)."""
  logps, old, ref, entropies, mask, advantages = _inputs()
  num_items = mask.sum() * 2  # dapo/cispo's normalizer: the rollout's tokens (here twice this batch's)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  keep = None if quantile >= 1 else grpo_objective.high_entropy_mask(f32(entropies), f32(mask), quantile)

  def ours(logps):
    return grpo_objective.policy_loss(logps, f32(old), f32(advantages), f32(mask), objective, f32(ref),
                                      jnp.float32(num_items), keep)

  (loss, stats), grad = jax.value_and_grad(ours, has_aux=True)(f32(logps))
  expected, expected_grad, metrics = _trl_loss(
      logps, old, ref, entropies, mask, advantages, num_items, beta=objective.beta, loss_type=objective.loss_type,
      importance_sampling_level=objective.importance_sampling_level, top_entropy_quantile=quantile,
      epsilon_low=objective.epsilon_low, epsilon_high=objective.epsilon_high,
      args={"use_bias_correction_kl": objective.use_bias_correction_kl,
            "sapo_temperature_pos": objective.sapo_temperature_pos,
            "sapo_temperature_neg": objective.sapo_temperature_neg})
  assert abs(float(loss) - expected) < 1e-6, (float(loss), expected)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, atol=1e-6, rtol=0)
  assert np.abs(expected_grad).max() > 1e-3  # the comparison is of a real gradient
  if objective.beta:
    assert float(stats.kl) == pytest.approx(metrics["kl"][0], abs=1e-6)
  else:
    assert float(stats.kl) == 0
  if objective.loss_type == "cispo":
    assert float(stats.clip_high) == pytest.approx(metrics["cispo_clip_ratio"][0], abs=1e-6)
    assert float(stats.clip_low) == 0
  elif objective.loss_type == "sapo":
    assert float(stats.clip_low) == float(stats.clip_high) == 0
  else:
    assert float(stats.clip_low) == pytest.approx(metrics["clip_ratio/low_mean"][0], abs=1e-6)
    assert float(stats.clip_high) == pytest.approx(metrics["clip_ratio/high_mean"][0], abs=1e-6)
    if objective.importance_sampling_level == "token":
      assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0


@pytest.mark.parametrize("level", grpo_objective.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", grpo_objective.LOSS_TYPES)
def test_loss_equals_trls(loss_type, level):
  """Every loss type at both importance sampling levels (sequence: GSPO), with the
  bias-corrected KL term (TRL's default); cispo with ScaleRL's cap 5.0 and 0.9 (the cap
  binds on some tokens either way at these ratios)."""
  for eps_high in ((5.0, 0.9) if loss_type == "cispo" else (EPS_HIGH,)):
    _check(grpo_objective.Objective(EPS_LOW, eps_high, BETA, loss_type, M, level))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_loss_without_kl_or_its_bias_correction_equals_trls(loss_type):
  _check(grpo_objective.Objective(EPS_LOW, EPS_HIGH, 0.0, loss_type, M))
  _check(grpo_objective.Objective(EPS_LOW, EPS_HIGH, BETA, loss_type, M, use_bias_correction_kl=False))


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
  _check(grpo_objective.Objective(EPS_LOW, EPS_HIGH, BETA, "dapo", M, level), quantile)


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
