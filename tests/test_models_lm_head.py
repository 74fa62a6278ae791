"""models/lm_head.py: the LM head and the loss's per-token terms, in chunks of tokens.

The terms and their gradients against float64 NumPy (softmax cross-entropy, log-probabilities
and entropies at a temperature, written out with their analytic gradients); the model's loss
and gradients with ``loss_chunk`` against the unchunked model's, on one device and on tp
(vocab-parallel), fs x tp with sequence parallelism, cp and pp meshes; GRPO's token
log-probabilities, entropies and objective gradient chunked against unchunked; and the
compiled step's temporaries shrinking with the chunk.
"""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import lm_head
from tests import model_meshes
from tests.test_models_gpt import np_token_losses

B, T, D, V, REAL_V = 3, 10, 16, 256, 200
TEMPERATURE = 0.7


def _head_inputs():
  rng = np.random.default_rng(0)
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = (rng.normal(size=(D, V)) / np.sqrt(D)).astype(np.float32)
  targets = rng.integers(0, REAL_V, (B, T))
  targets[0, 3] = targets[2, 9] = -1  # not counted
  return h, w, targets


def _np_terms(h, w, targets, vocab_size, temperature):
  """float64 logits / temperature -> (target logit, log-sum-exp, mean logit) [B, T] and the
  softmax [B, T, V], the padding ids (>= vocab_size) left out."""
  z = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
  z = np.where(np.arange(V) < vocab_size, z, -np.inf)
  m = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - m).sum(-1)) + m[..., 0]
  p = np.exp(z - lse[..., None])
  target = np.where(targets >= 0, np.take_along_axis(z, np.maximum(targets, 0)[..., None], -1)[..., 0], 0.0)
  mean = np.sum(p * np.where(np.isfinite(z), z, 0.0), -1)
  return target, lse, mean, p, z


# 7 tokens a chunk does not divide the 30 tokens (the last chunk padded), 30 is one chunk.
@pytest.mark.parametrize("chunk", [0, 7, 30])
def test_cross_entropy_and_gradients_match_float64(chunk):
  """Σ of the counted tokens' cross-entropy over the whole vocabulary (``mask_vocab_padding``
  off: the padding ids count), its gradient dz = softmax − one-hot written out; float32
  reaches 3e-7 relative on the loss, 2e-6 on the gradients here."""
  h, w, targets = _head_inputs()

  def total(h, w):
    terms = lm_head.head_terms(h, w, jnp.asarray(targets), models.Parallelism(), vocab_size=None, chunk=chunk)
    return jnp.sum(jnp.where(targets >= 0, terms.normalizer - terms.target, 0.0))

  loss, (dh, dw) = jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(h, w)
  target, lse, _, p, _ = _np_terms(h, w, targets, V, 1.0)
  counted = targets >= 0
  want = np.sum(np.where(counted, lse - target, 0.0))
  dz = np.where(counted[..., None], p - (np.arange(V) == targets[..., None]), 0.0)
  np.testing.assert_allclose(float(loss), want, rtol=2e-6)
  np.testing.assert_allclose(dh, dz @ w.T.astype(np.float64), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw, np.einsum("btd,btv->dv", h.astype(np.float64), dz), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 7])
def test_log_probabilities_entropies_and_gradients_match_float64(chunk):
  """GRPO's terms at a temperature, padding ids left out: each target's log-probability and
  each distribution's entropy, and the gradient of Σ a·logp + Σ b·entropy (random a, b):
  dz = (a·(one-hot − p) + b·p·(mean logit − z)) / temperature."""
  h, w, targets = _head_inputs()
  rng = np.random.default_rng(1)
  a, b = rng.normal(size=(B, T)), rng.normal(size=(B, T))

  def terms(h, w):
    out = lm_head.head_terms(h, w, jnp.asarray(targets), models.Parallelism(), vocab_size=REAL_V, chunk=chunk,
                             temperature=TEMPERATURE, entropy=True)
    return jnp.where(targets >= 0, out.target - out.normalizer, 0.0), out.normalizer - out.mean_logit

  def objective(h, w):
    logps, entropies = terms(h, w)
    return jnp.sum(a * logps) + jnp.sum(b * entropies)

  logps, entropies = jax.jit(terms)(h, w)
  dh, dw = jax.jit(jax.grad(objective, argnums=(0, 1)))(h, w)
  target, lse, mean, p, z = _np_terms(h, w, targets, REAL_V, TEMPERATURE)
  counted = targets >= 0
  np.testing.assert_allclose(logps, np.where(counted, target - lse, 0.0), rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(entropies, lse - mean, rtol=1e-5, atol=2e-6)
  onehot = np.arange(V) == np.where(counted, targets, -1)[..., None]
  dz = (a[..., None] * (onehot - np.where(counted[..., None], p, 0.0))
        + b[..., None] * p * (mean[..., None] - np.where(np.isfinite(z), z, 0.0))) / TEMPERATURE
  np.testing.assert_allclose(dh, dz @ w.T.astype(np.float64), rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(dw, np.einsum("btd,btv->dv", h.astype(np.float64), dz), rtol=1e-5, atol=2e-6)


# --- the model's loss, chunked, against the unchunked one on every mesh kind -------------

CFG = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=16)
# 24 tokens divide none of the meshes' token counts per device (128, 64): the last chunk is padded.
CHUNKED = dataclasses.replace(CFG, loss_chunk=24)


def _batch(cfg=CFG, seed=0, batch=8):
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


@pytest.fixture(scope="module")
def unchunked():
  """(loss, gradients in layer order) of the unchunked model on one device."""
  _, loss, grads = model_meshes.one_device(CFG, _batch())
  return loss, grads


def test_chunked_loss_matches_float64_and_the_unchunked_gradients(unchunked):
  """The chunked loss against the float64 forward pass (test_models_gpt's), its gradients
  against the unchunked model's: float32 rounding (measured 3.6e-7 relative)."""
  graphdef, params = models.init(CHUNKED)
  batch = _batch()
  loss, grads = jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch)))(params)
  want = np.mean(np_token_losses(params, CFG, np.asarray(batch["inputs"]), np.asarray(batch["targets"])))
  np.testing.assert_allclose(float(loss), want, rtol=2e-6)
  np.testing.assert_allclose(float(loss), unchunked[0], rtol=1e-6)
  model_meshes.assert_close_trees(grads, unchunked[1], rtol=2e-6)


MESHES = [
    # The vocabulary over tp, chunks of each fs shard's tokens, inside Dion's per-replica
    # gradient (a shard_map manual over rp).
    ("rp=2,fs=2,tp=2", {"sequence_parallel": True}),
    ("cp=2", {}),
    ("pp=2", {"microbatches": 4}),
]


@pytest.mark.parametrize("spec,options", MESHES, ids=[f"{s}{o}" for s, o in MESHES])
def test_chunked_loss_on_a_mesh_matches_one_device_unchunked(unchunked, spec, options):
  graphdef, _ = models.abstract(CHUNKED)
  model_meshes.assert_mesh_matches((graphdef, *unchunked), CHUNKED, _batch(), spec, options)


@pytest.mark.parametrize("spec", [None, "fs=2,cp=2,tp=2"])
def test_grpo_log_probabilities_and_entropies_chunked_match_unchunked(spec):
  """``models.token_logps`` (GRPO's old and reference log-probabilities, with entropies)
  and the gradient of an objective of both (``models.loss(objective=...)``), chunked
  against unchunked on one device and split over fs, cp and tp (the pipeline's way is cp's:
  ``models.lm_loss._manual_call``): each device's 32 tokens in a chunk of 24 and a padded one."""
  batch = _batch()
  targets = np.asarray(batch["targets"]).copy()
  targets[1, :5] = -1  # a prompt's positions count nothing
  weights = jnp.asarray(np.random.default_rng(2).normal(size=targets.shape), jnp.float32)
  batch = {**batch, "targets": jnp.asarray(targets), "weights": weights}

  def objective(logps, entropies, fields):
    return fields["weights"] * logps + 0.1 * entropies, {}

  par = models.Parallelism(None if spec is None else model_meshes.mesh(spec))
  got = []
  for cfg in (CFG, CHUNKED):
    graphdef, params = models.init(cfg, par)
    with jax.set_mesh(par.mesh) if par.mesh is not None else contextlib.nullcontext():
      logps = jax.jit(lambda p: models.token_logps(graphdef, p, batch, par, TEMPERATURE, entropy=True))(params)
      grads = jax.jit(jax.grad(lambda p: models.loss(graphdef, p, batch, par, objective=objective,
                                                     temperature=TEMPERATURE)))(params)
    got.append((logps, model_meshes.in_layer_order(grads, par)))
  (logps, grads), (want_logps, want_grads) = got[1], got[0]
  for g, w in zip(logps, want_logps):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(logps[0])[1, :5] == 0) and np.all(np.asarray(logps[1])[1, :5] == 0)
  model_meshes.assert_close_trees(grads, want_grads, rtol=1e-5)


# --- what chunking saves ----------------------------------------------------------------


def test_compiled_temporaries_hold_one_chunk_of_logits():
  """The compiled loss-and-gradient's temporary memory: unchunked it holds several float32
  buffers of every token's logits [N, V] (logits, softmax, their gradient); chunked, the
  logits' share shrinks to a few [chunk, V] buffers, so going from 512 tokens at once to
  chunks of 64 saves at least two of the [512, V] buffers."""
  cfg = models.preset("tiny", num_layers=1, d_model=32, num_heads=2, seq_len=128, vocab_size=8192)
  batch = {k: jax.ShapeDtypeStruct((4, cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}

  def temporaries(chunk):
    graphdef, params = models.abstract(dataclasses.replace(cfg, loss_chunk=chunk))
    compiled = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b))).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  logits_bytes = 4 * cfg.seq_len * cfg.padded_vocab * 4
  unchunked, chunked = temporaries(0), temporaries(64)
  assert unchunked >= 2 * logits_bytes, unchunked / logits_bytes
  assert chunked <= unchunked - 2 * logits_bytes, (unchunked / logits_bytes, chunked / logits_bytes)
