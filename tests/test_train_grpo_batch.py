"""train/grpo/batch.py: the update's rows. Packed (several completions, each after its
prompt, to a row) and padded (one to a row, the prompt left-padded) hold the same targets
where the layout says; on a rollout whose lengths vary widely the packed update's loss,
statistics and gradient equal the padded one's (the reference: the layout the update had
before packing) and a plain per-sequence forward's, for token- and sequence-level objectives
(GSPO, VESPO, OPSM and the entropy bonus sum over each completion's tokens)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from data import packing
from train import sample
from train.grpo import batch as grpo_batch
from train.grpo import objective as grpo_objective

SEQ_LEN, B, M, TEMPERATURE = 32, 16, 16, 0.7


def _rollout(vocab_size: int, seed: int = 0):
  """Prompts of 1 to 12 tokens and completions of 1 to 16 (one of each extreme)."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, vocab_size, n).astype(np.int32) for n in rng.integers(1, 13, B)]
  prompts[0] = prompts[0][:1]
  lengths_B = rng.integers(1, M + 1, B)
  lengths_B[:2] = M, 1
  return prompts, rng.integers(0, vocab_size, (B, M)).astype(np.int32), lengths_B


def test_first_fit_decreasing_places_every_example_once_within_its_row():
  rng = np.random.default_rng(0)
  lengths_E = rng.integers(1, 33, 200)
  row_E, start_E = packing.first_fit_decreasing(lengths_E, 32)
  for r in range(row_E.max() + 1):
    spans = sorted((start_E[e], start_E[e] + lengths_E[e]) for e in np.nonzero(row_E == r)[0])
    assert spans[0][0] >= 0 and spans[-1][1] <= 32
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
  assert row_E.max() + 1 <= int(np.ceil(11 / 9 * lengths_E.sum() / 32)) + 1


@pytest.mark.parametrize("unit", [1, 8])
def test_both_layouts_predict_each_completion_token_where_their_index_says(unit):
  """At index (b, j): the target is completion b's token j, the input before it the
  previous token (the prompt's last for j = 0), in the same segment at position
  len(prompt) + j - 1; packed rows are fewer, a multiple of ``unit``, and as long."""
  prompts, completions_BxM, lengths_B = _rollout(257)
  packed = grpo_batch.packed(prompts, completions_BxM, lengths_B, SEQ_LEN, unit)
  padded = grpo_batch.padded(prompts, completions_BxM, lengths_B)
  for layout in (packed, padded):
    flat = {k: v.ravel() for k, v in layout.batch.items()}
    for b, (prompt, n) in enumerate(zip(prompts, lengths_B)):
      index = layout.index_BxM[b]
      assert (index[n:] == -1).all() and (index[:n] >= 0).all()
      np.testing.assert_array_equal(flat["targets"][index[:n]], completions_BxM[b, :n])
      np.testing.assert_array_equal(flat["inputs"][index[:n]], np.concatenate([prompt[-1:], completions_BxM[b, :n - 1]]))
      np.testing.assert_array_equal(flat["positions"][index[:n]], len(prompt) - 1 + np.arange(n))
      assert len(set(flat["segment_ids"][index[:n]])) == 1 and flat["segment_ids"][index[0]] > 0
  assert (packed.batch["targets"] >= 0).sum() == lengths_B.sum()  # padded rows keep M slots a completion
  rows = packed.batch["inputs"].shape[0]
  assert rows % unit == 0 and rows < padded.batch["inputs"].shape[0]
  assert packed.batch["inputs"].shape[1] == padded.batch["inputs"].shape[1]  # no longer attention span


# The objectives compared: the token level with δ and the high-entropy mask; GSPO's sequence
# level; VESPO with OPSM and the entropy bonus (sums over each completion's tokens).
CASES = {
    "dapo_delta_keep": (grpo_objective.Objective(beta=0.04, delta=1.5, sequences=B), 0.5),
    "gspo": (grpo_objective.Objective(beta=0.04, loss_type="grpo", importance_sampling_level="sequence",
                                      sequences=B), 1.0),
    "vespo_opsm_entropy": (grpo_objective.Objective(beta=0.04, loss_type="vespo", off_policy_mask_threshold=0.05,
                                                    entropy_coef=0.05, sequences=B), 1.0),
}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _value_and_grad(graphdef, objective, params, batch):
  def loss_fn(params):
    loss, aux = models.loss(graphdef, params, batch, denominator=jnp.float32(1), aux=True,
                            objective=functools.partial(grpo_objective.weighted, objective), temperature=TEMPERATURE)
    return loss, aux.stats
  return jax.value_and_grad(loss_fn, has_aux=True)(params)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _per_sequence_value_and_grad(graphdef, objective, vocab_size, params, tokens_BxT, first_B, inputs):
  """The loss by a plain forward of each prompt and completion alone, right-padded (causal:
  the padding is after every token that counts), through policy_loss."""
  old_BxM, ref_BxM, advantages_B, mask_BxM = inputs

  def loss_fn(params):
    layers = dict(params, blocks=models.to_layers(params["blocks"], 1))
    logits_BxTxV = sample.logits(graphdef, layers, tokens_BxT)[..., :vocab_size] / TEMPERATURE
    predicting_BxMxV = jnp.take_along_axis(jax.nn.log_softmax(logits_BxTxV),
                                           (first_B[:, None] + jnp.arange(M))[..., None], 1)
    targets_BxM = jnp.take_along_axis(tokens_BxT, first_B[:, None] + 1 + jnp.arange(M), 1)
    logps_BxM = jnp.take_along_axis(predicting_BxMxV, targets_BxM[..., None], -1)[..., 0] * mask_BxM
    entropies_BxM = -jnp.sum(jnp.exp(predicting_BxMxV) * predicting_BxMxV, -1) * mask_BxM
    return grpo_objective.policy_loss(logps_BxM, old_BxM, advantages_B, mask_BxM, objective, ref_BxM,
                                      mask_BxM.sum(), None, entropies_BxM, objective.entropy_coef)
  return jax.value_and_grad(loss_fn, has_aux=True)(params)


@pytest.fixture(scope="module")
def rollout():
  """A 2-layer model and a rollout's update inputs: old and reference log-probs off the
  policy's by noise, advantages, the completions' masks."""
  cfg = models.preset("tiny", num_layers=2, d_model=32, num_heads=2, seq_len=SEQ_LEN)
  graphdef, params = models.init(cfg, seed=0)
  prompts, completions_BxM, lengths_B = _rollout(cfg.vocab_size)
  layouts = {"packed": grpo_batch.packed(prompts, completions_BxM, lengths_B, SEQ_LEN),
             "padded": grpo_batch.padded(prompts, completions_BxM, lengths_B)}
  logps_BxM, entropies_BxM = grpo_batch.token_logps(graphdef, params, layouts["padded"], TEMPERATURE, entropy=True)
  rng = np.random.default_rng(1)
  mask_BxM = jnp.asarray(np.arange(M)[None] < lengths_B[:, None], jnp.float32)
  old_BxM, ref_BxM = ((logps_BxM + jnp.asarray(rng.normal(0, 0.3, (B, M)), jnp.float32)) * mask_BxM for _ in range(2))
  inputs = (old_BxM, ref_BxM, jnp.asarray(rng.normal(size=B), jnp.float32), mask_BxM)
  return cfg, graphdef, params, (prompts, completions_BxM, lengths_B), layouts, entropies_BxM, inputs


@pytest.mark.parametrize("case", CASES)
def test_packed_update_equals_padded(rollout, case):
  """The packed batch's loss, statistics and gradient are the padded batch's (float32 on
  CPU; 8 rows of 32 against 16 of 32). Achieved: loss within 2.6e-7 relative, statistics
  within 2e-7 relative, gradients within 3.6e-7 of their largest entry; checked at about
  4-5x."""
  cfg, graphdef, params, _, layouts, entropies_BxM, inputs = rollout
  objective, quantile = CASES[case]
  keep_BxM = None if quantile >= 1 else grpo_objective.high_entropy_mask(entropies_BxM, inputs[-1], quantile)
  fields = grpo_objective.per_token_fields(*inputs, objective, inputs[-1].sum(), keep_BxM, objective.entropy_coef)
  (loss, stats), grads = _value_and_grad(graphdef, objective, params, grpo_batch.update_batch(layouts["packed"], fields))
  (expected, expected_stats), expected_grads = _value_and_grad(graphdef, objective, params,
                                                               grpo_batch.update_batch(layouts["padded"], fields))
  assert layouts["packed"].batch["inputs"].shape[0] < layouts["padded"].batch["inputs"].shape[0]
  assert float(loss) == pytest.approx(float(expected), rel=1e-6)
  np.testing.assert_allclose(np.asarray(stats), np.asarray(expected_stats), rtol=1e-6, atol=1e-8)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected_grads))
  assert np.isfinite(scale) and scale > 1e-3
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6 * scale, rtol=0,
                               err_msg=jax.tree_util.keystr(path))


def test_packed_update_equals_each_sequence_alone(rollout):
  """VESPO with OPSM and the entropy bonus: the packed update's loss and gradient (the
  entropy's too) are those of a plain forward of each prompt and completion alone.
  Achieved: loss within 9e-7 relative, gradients within 1.6e-6 of their largest entry
  (another log-softmax and entropy over the vocabulary); checked at about 5x."""
  cfg, graphdef, params, (prompts, completions_BxM, lengths_B), layouts, _, inputs = rollout
  objective, _ = CASES["vespo_opsm_entropy"]
  fields = grpo_objective.per_token_fields(*inputs, objective, inputs[-1].sum(), None, objective.entropy_coef)
  (loss, _), grads = _value_and_grad(graphdef, objective, params, grpo_batch.update_batch(layouts["packed"], fields))
  tokens_BxT = np.zeros((B, max(map(len, prompts)) + M), np.int32)
  for b, (prompt, completion) in enumerate(zip(prompts, completions_BxM)):
    tokens_BxT[b, :len(prompt) + M] = np.concatenate([prompt, completion])
  first_B = jnp.asarray([len(p) - 1 for p in prompts])
  (expected, _), expected_grads = _per_sequence_value_and_grad(graphdef, objective, cfg.vocab_size, params,
                                                               jnp.asarray(tokens_BxT), first_B, inputs)
  assert float(loss) == pytest.approx(float(expected), rel=4e-6)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected_grads))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=8e-6 * scale, rtol=0,
                               err_msg=jax.tree_util.keystr(path))
