"""train/grpo_objective.py against TRL: the loss, its gradient and its statistics are what
``GRPOTrainer._compute_loss`` (TRL's own code, called on a stand-in trainer whose model
returns the given log-probabilities) computes on the same inputs, for every aggregation,
with and without the KL term; the advantages are TRL's group normalization (its
``nanstd``)."""
import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import grpo_objective

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

G, PROMPTS, M = 4, 3, 7
B = G * PROMPTS


def _inputs():
  rng = np.random.default_rng(0)
  logps = -rng.exponential(1.0, (B, M))
  old = logps + rng.normal(0, 0.3, (B, M))  # ratios well outside [0.8, 1.28]: clipping happens
  ref = logps + rng.normal(0, 0.5, (B, M))
  lengths = rng.integers(1, M + 1, B)
  lengths[0], lengths[1] = M, 1
  mask = (np.arange(M)[None] < lengths[:, None]).astype(np.float64)
  advantages = rng.normal(0, 1, B)
  return logps, old, ref, mask, advantages


def _trl_loss(loss_type, beta, logps, old, ref, mask, advantages, eps_low, eps_high, num_items):
  """TRL's _compute_loss on these inputs (float64): loss, d loss / d logps, and its metrics."""
  logps_t = torch.tensor(logps, requires_grad=True)
  accelerator = types.SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                      reduce=lambda x, reduction: x, gather_for_metrics=lambda x: x)
  trainer = types.SimpleNamespace(
      _get_per_token_logps_and_entropies=lambda *a, **k: (logps_t, torch.zeros_like(logps_t), None),
      aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
      importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps_low,
      epsilon_high=eps_high, use_vllm=False, model=types.SimpleNamespace(training=True),
      current_gradient_accumulation_steps=1, max_completion_length=M, accelerator=accelerator,
      _entropy_bonus_enabled=False, _metrics={"train": collections.defaultdict(list)},
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1))
  inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
            "completion_ids": torch.zeros(B, M, dtype=torch.long), "completion_mask": torch.tensor(mask),
            "advantages": torch.tensor(advantages), "old_per_token_logps": torch.tensor(old),
            "ref_per_token_logps": torch.tensor(ref), "num_items_in_batch": torch.tensor(num_items)}
  loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  return float(loss.detach()), logps_t.grad.numpy(), trainer._metrics["train"]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("aggregation", grpo_objective.AGGREGATIONS)
def test_loss_equals_trl(aggregation, beta):
  """Loss and gradient within 1e-6 of TRL's (float32 here, float64 there; achieved ~1e-7),
  clip-higher (ε_low 0.2, ε_high 0.28), ``dapo``'s normalizer the rollout's tokens (here
  a larger number than this batch's, as when the rollout is split over updates)."""
  logps, old, ref, mask, advantages = _inputs()
  num_items = mask.sum() * 2
  objective = grpo_objective.Objective(0.2, 0.28, beta, aggregation, M)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

  def ours(logps):
    return grpo_objective.policy_loss(logps, f32(old), f32(advantages), f32(mask), objective, f32(ref),
                                      jnp.float32(num_items))

  (loss, stats), grad = jax.value_and_grad(ours, has_aux=True)(f32(logps))
  expected, expected_grad, metrics = _trl_loss(aggregation, beta, logps, old, ref, mask, advantages, 0.2, 0.28,
                                               num_items)
  assert abs(float(loss) - expected) < 1e-6, (float(loss), expected)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, atol=1e-6, rtol=0)
  assert float(stats.clip_low) == pytest.approx(metrics["clip_ratio/low_mean"][0], abs=1e-6)
  assert float(stats.clip_high) == pytest.approx(metrics["clip_ratio/high_mean"][0], abs=1e-6)
  assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0
  if beta:
    assert float(stats.kl) == pytest.approx(metrics["kl"][0], abs=1e-6)
  else:
    assert float(stats.kl) == 0


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_are_trls_group_normalization(scale):
  """Two reward functions weighted 1 and 0.5 summed, then centered within each group of G
  and divided by TRL's nanstd (Bessel-corrected) + 1e-4 (``scale_rewards="group"``), or
  only centered (``"none"``); a group of equal rewards gets advantages 0."""
  rng = np.random.default_rng(1)
  rewards_BxR = rng.integers(0, 3, (B, 2)).astype(np.float64)
  rewards_BxR[:G] = [1.0, 2.0]
  weights = np.asarray([1.0, 0.5])
  r = torch.tensor(rewards_BxR @ weights)
  expected = r - r.view(-1, G).mean(1).repeat_interleave(G)
  if scale:
    expected = expected / (trl_utils.nanstd(r.view(-1, G), dim=1).repeat_interleave(G) + 1e-4)
  got = grpo_objective.advantages(jnp.asarray(rewards_BxR, jnp.float32), jnp.asarray(weights, jnp.float32), G, scale)
  np.testing.assert_allclose(np.asarray(got), expected.numpy(), atol=1e-5, rtol=0)
  assert np.all(np.asarray(got)[:G] == 0)
