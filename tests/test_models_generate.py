"""models/generate.py: the cached path against the full recompute, greedy completions
against transformers' ``generate``, sampled tokens against softmax(logits / T) after
top-k/top-p (float64 NumPy), and the stop at eos."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dion_jax
import models
from models import generate
from tests import extras
from train import sample
from train.store import hf as hf_io

torch = pytest.importorskip("torch", reason=extras.TORCH)
transformers = pytest.importorskip("transformers", reason=extras.TORCH)
from tests.test_models_hf import make_hf_model  # noqa: E402

# left-padded to one bucket of 16: 13, 6 and 1 padding slots
PROMPT_LENGTHS = (3, 10, 15)


def _prompts(vocab: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, n).astype(np.int32) for n in PROMPT_LENGTHS]


def _layered(params):
  return dict(params, blocks=models.to_layers(params["blocks"], 1))


@pytest.mark.parametrize("moe_every", [0, 2])
def test_cache_bytes_are_the_caches(moe_every):
  """What train.sample checks against the device's memory is what the sampler allocates
  (the layers grouped by the mixture of experts too)."""
  cfg = models.GPTConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, num_layers=4, seq_len=16,
                         dtype="bfloat16", **({"num_experts": 4, "moe_every": moe_every} if moe_every else {}))
  keys, values = jax.eval_shape(lambda: generate.init_cache(cfg, 3, 21))
  assert generate.cache_bytes(cfg, 3, 21) == (np.prod(keys.shape) + np.prod(values.shape)) * 2 == 2 * 3 * 21 * 4 * 2 * 8 * 2


def test_cache_path_equals_full_recompute():
  """Prefill of left-padded prompts, then teacher-forced tokens one at a time through the
  cache: every step's logits are the full forward's (sample.logits on the unpadded
  sequence) at that position. The model: grouped-query attention (4 query heads over 2
  kv heads), QK-norm, mixtures of experts on every second layer, so that the layers run
  in groups (models.gpt.Group; transformers' tests cover the plain Block).
  Achieved: 2e-6 in float32."""
  cfg = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, seq_len=32, num_experts=4,
                      moe_every=2, moe_top_k=2, mlp_dim=64)
  graphdef, params = models.init(cfg, seed=1)
  params = _layered(params)
  prompts, steps = _prompts(cfg.vocab_size), 6
  forced_BxM = np.random.default_rng(1).integers(0, cfg.vocab_size, (len(prompts), steps)).astype(np.int32)
  prompts_BxP, lengths_B = generate.left_pad(prompts, 16)
  pad_B = jnp.asarray(16 - lengths_B)
  forward = jax.jit(generate.forward, static_argnums=0)
  logits_BxV, cache = forward(graphdef, params, prompts_BxP, pad_B, jnp.int32(0),
                              generate.init_cache(cfg, len(prompts), 16 + steps))
  cached = [logits_BxV]
  for t in range(steps - 1):
    logits_BxV, cache = forward(graphdef, params, forced_BxM[:, t:t + 1], pad_B, jnp.int32(16 + t), cache)
    cached.append(logits_BxV)
  # the full forward of each whole sequence, right-padded (causal: the padding comes after)
  full_BxT = np.zeros((len(prompts), max(PROMPT_LENGTHS) + steps), np.int32)
  for b, p in enumerate(prompts):
    full_BxT[b, :len(p) + steps] = np.concatenate([p, forced_BxM[b]])
  full_BxTxV = np.asarray(sample.logits(graphdef, params, full_BxT))
  for b, p in enumerate(prompts):
    expected = full_BxTxV[b, len(p) - 1:len(p) - 1 + steps]
    np.testing.assert_allclose(np.stack([np.asarray(c[b]) for c in cached]), expected, atol=2e-5, rtol=0)


def _hf_generate(model, prompts_BxP, lengths_B, max_new, eos):
  mask_BxP = (np.arange(prompts_BxP.shape[1])[None] >= prompts_BxP.shape[1] - lengths_B[:, None])
  with torch.no_grad():
    out = model.generate(torch.as_tensor(prompts_BxP, dtype=torch.long),
                         attention_mask=torch.as_tensor(mask_BxP, dtype=torch.long), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos, pad_token_id=0)
  new = out[:, prompts_BxP.shape[1]:].numpy()
  return np.pad(new, ((0, 0), (0, max_new - new.shape[1])))  # generate stops when all are done


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_equals_transformers_generate(tmp_path, arch):
  """Left-padded prompts of three lengths, 12 new tokens: token for token transformers'
  cached greedy ``generate``; then with an eos that sequence 1 writes at step 3 (or before;
  taken from transformers' output), which ends the sequences that write it there and pads
  them with 0."""
  model = make_hf_model(arch, tmp_path)
  model.generation_config.eos_token_id = None
  cfg = hf_io.model_config(str(tmp_path), seq_len=32)
  graphdef, params = hf_io.load(str(tmp_path), cfg, models.Parallelism())
  params = _layered(params)
  prompts_BxP, lengths_B = generate.left_pad(_prompts(cfg.vocab_size), 16)
  max_new = 12
  expected = _hf_generate(model, prompts_BxP, lengths_B, max_new, eos=None)
  ours = generate.generate(graphdef, params, prompts_BxP, lengths_B, jax.random.key(0), max_new_tokens=max_new)
  np.testing.assert_array_equal(np.asarray(ours.tokens_BxM), expected)
  eos = int(expected[1, 3])
  expected = _hf_generate(model, prompts_BxP, lengths_B, max_new, eos=eos)
  ours = generate.generate(graphdef, params, prompts_BxP, lengths_B, jax.random.key(0), max_new_tokens=max_new,
                           eos_id=eos)
  np.testing.assert_array_equal(np.asarray(ours.tokens_BxM), expected)
  ends_B = [list(row).index(eos) + 1 if eos in row else max_new for row in expected]
  assert ends_B[1] <= 4 and all(np.all(row[end:] == 0) for row, end in zip(expected, ends_B))
  np.testing.assert_array_equal(np.asarray(ours.lengths_B), ends_B)


def _warped_probs(logits_V: np.ndarray, temperature: float, top_k, top_p: float) -> np.ndarray:
  """transformers' warpers in float64: temperature, top-k, then top-p (the smallest set of
  the likeliest tokens whose probability reaches top_p)."""
  z = logits_V.astype(np.float64) / temperature
  if top_k is not None:
    z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
  p = np.exp(z - z.max())
  p /= p.sum()
  order = np.argsort(-p)
  before = np.cumsum(p[order]) - p[order]
  keep = np.zeros_like(p, bool)
  keep[order[before < top_p]] = True
  p = np.where(keep, p, 0.0)
  return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, 1.0), (1.5, 5, 1.0), (1.0, None, 0.8),
                                                       (0.9, 6, 0.7)])
def test_sampled_tokens_follow_the_warped_softmax(temperature, top_k, top_p):
  """20000 draws from one row of logits over 10 tokens (and 118 padding rows): the counts
  pass a chi-square test against the float64 probabilities at p = 0.001, and no token
  outside the kept set is ever drawn."""
  n, vocab = 20000, 10
  logits_V = np.linspace(-2.0, 1.5, vocab) + np.random.default_rng(0).normal(0, 0.3, vocab)
  padded_V = np.concatenate([logits_V, np.full(128 - vocab, 5.0)])  # padding rows would dominate
  sampling = generate.Sampling(temperature, top_k, top_p)
  tokens_B, _ = jax.jit(generate._choose, static_argnums=(2, 3))(
      jnp.asarray(np.tile(padded_V, (n, 1)), jnp.float32), jax.random.key(0), sampling, vocab)
  counts = np.bincount(np.asarray(tokens_B), minlength=128)
  expected = _warped_probs(logits_V, temperature, top_k, top_p)
  kept = expected > 0
  assert counts[vocab:].sum() == 0 and counts[:vocab][~kept].sum() == 0
  statistic = np.sum((counts[:vocab][kept] - n * expected[kept]) ** 2 / (n * expected[kept]))
  assert statistic < stats.chi2.ppf(0.999, kept.sum() - 1), (statistic, counts[:vocab], n * expected)


def test_generated_first_tokens_follow_the_models_softmax():
  """End to end: 2000 copies of one prompt, one token each with top-k 8 at T = 0.8: the
  counts follow the full forward's warped softmax (chi-square, p = 0.001); the reported
  log-probabilities are log softmax(logits / T) of the full forward (achieved 1e-6)."""
  cfg = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=32)
  graphdef, params = models.init(cfg, seed=2)
  params = _layered(params)
  prompt = _prompts(cfg.vocab_size)[1]
  sampling = generate.Sampling(0.8, 8, 1.0)
  out = generate.complete(graphdef, params, [prompt] * 2000, 1, sampling, seed=3)
  logits_V = np.asarray(sample.logits(graphdef, params, prompt[None]))[0, -1, :cfg.vocab_size].astype(np.float64)
  expected = _warped_probs(logits_V, 0.8, 8, 1.0)
  counts = np.bincount(np.asarray(out.tokens_BxM[:, 0]), minlength=cfg.vocab_size)
  kept = expected > 0
  assert counts[~kept].sum() == 0
  statistic = np.sum((counts[kept] - 2000 * expected[kept]) ** 2 / (2000 * expected[kept]))
  assert statistic < stats.chi2.ppf(0.999, kept.sum() - 1)
  z = logits_V / 0.8
  logsoftmax_V = z - z.max() - np.log(np.exp(z - z.max()).sum())
  np.testing.assert_allclose(np.asarray(out.logprobs_BxM[:, 0]), logsoftmax_V[np.asarray(out.tokens_BxM[:, 0])],
                             atol=1e-5)
  # the same seed draws the same tokens; another seed others
  again = generate.complete(graphdef, params, [prompt] * 2000, 1, sampling, seed=3)
  np.testing.assert_array_equal(np.asarray(again.tokens_BxM), np.asarray(out.tokens_BxM))


def test_the_cache_is_not_copied_whole_per_layer():
  """The sampler's program copies the stacked cache (every layer's keys or values) a few
  times per token at most, never inside the loop over layers: carried through that loop,
  read and updated in one iteration, it was copied four times per layer and token (9
  copies in this program; 12 layers decoded 3.5x slower per token)."""
  cfg = models.preset("tiny", num_layers=4, d_model=64, num_heads=4, seq_len=32)
  graphdef, params = models.init(cfg, seed=0)
  prompts_BxP, lengths_B = generate.left_pad(_prompts(cfg.vocab_size), 16)
  hlo = generate._generate.lower(graphdef, _layered(params), prompts_BxP, lengths_B, jax.random.key(0), jnp.int32(-1),
                                 max_new_tokens=48, sampling=generate.Sampling(), pad_id=0).compile().as_text()
  whole = f"f32[4,{len(PROMPT_LENGTHS)},64,4,16]"  # [layers, B, P + M slots, kv heads, head dim]
  copies = [line for line in hlo.splitlines() if f"= {whole}" in line and " copy(" in line]
  assert whole in hlo and len(copies) <= 4, copies


@pytest.mark.parametrize("eos", [None, "the 5th token"])
def test_streamed_chunks_are_the_completions_tokens(eos):
  """``stream`` (train.sample's path, a few steps per call) writes ``complete``'s tokens
  (one loop over all of them): the same sampled tokens (top-k, top-p), chunk by chunk,
  whatever the chunk; with an eos, up to and with it, then nothing more. Tokens, not
  floats: both run the same step on the same position's key, so only logits within float
  rounding of a tie (none in these 20 draws) could pick another."""
  cfg = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=32)
  graphdef, params = models.init(cfg, seed=4)
  params, prompt = _layered(params), _prompts(cfg.vocab_size)[1]
  sampling = generate.Sampling(0.9, 20, 0.95)
  whole = np.asarray(generate.complete(graphdef, params, [prompt], 20, sampling, seed=5).tokens_BxM[0])
  eos_id = None if eos is None else int(whole[4])
  stop = 20 if eos is None else list(whole).index(eos_id) + 1
  for chunk in (3, 20):
    chunks = list(generate.stream(graphdef, params, prompt, 20, sampling, seed=5, eos_id=eos_id, chunk=chunk))
    assert all(len(c) <= chunk for c in chunks)
    np.testing.assert_array_equal(np.concatenate(chunks), whole[:stop])


def test_sharded_rollout_writes_the_single_device_tokens():
  """Parameters initialized on fs=2,pp=2,tp=2 (8 devices), gathered once for the rollout
  (blocks in layer order, still split over tp): the same sampled tokens (top-k, top-p) as
  on one device, and log-probabilities within 1e-5 (achieved 1.2e-6)."""
  cfg = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, seq_len=32)
  graphdef, params = models.init(cfg, seed=1)
  prompts, sampling = _prompts(cfg.vocab_size), generate.Sampling(0.9, 20, 0.95)
  expected = generate.complete(graphdef, _layered(params), prompts, 8, sampling, seed=1, group_size=2)
  mesh = dion_jax.make_mesh("fs=2,pp=2,tp=2", jax.devices()[:8])
  par = models.Parallelism(mesh, microbatches=2)
  graphdef, params = models.init(cfg, par, seed=1)
  rollout = generate.rollout_params(params, par)
  assert rollout["blocks"]["attn"]["query"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
  got = generate.complete(graphdef, rollout, prompts, 8, sampling, seed=1, group_size=2)
  np.testing.assert_array_equal(np.asarray(got.tokens_BxM), np.asarray(expected.tokens_BxM))
  np.testing.assert_allclose(np.asarray(got.logprobs_BxM), np.asarray(expected.logprobs_BxM), atol=1e-5)
  # The rollout's rows split over the batch axes (fs=2), the model over tp: each device keeps
  # 3 of the 6 rows' cache [units, B, S, K, H] with 1 of the 2 key/value heads, and
  # samples the same tokens.
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(models.BATCH_AXES))
  split = generate.complete(graphdef, rollout, prompts, 8, sampling, seed=1, group_size=2, batch_sharding=rows)
  np.testing.assert_array_equal(np.asarray(split.tokens_BxM), np.asarray(expected.tokens_BxM))
  assert split.tokens_BxM.sharding.shard_shape(split.tokens_BxM.shape) == (3, 8)
  prompts_BxP, lengths_B = generate.left_pad(prompts, 16)
  inputs = jax.device_put((np.repeat(prompts_BxP, 2, 0), np.repeat(lengths_B, 2)), rows)
  text = generate._generate.lower(graphdef, rollout, *inputs, jax.random.key(1), jnp.int32(-1), max_new_tokens=8,
                                  sampling=sampling, pad_id=0).compile().as_text()
  assert "f32[2,3,24,1,16]" in text and "f32[2,6,24" not in text
