"""Sampling with a key/value cache: prefill the prompts once, then one token per step.

    out = generate.complete(graphdef, params, prompts, max_new_tokens=64,
                            sampling=generate.Sampling(temperature=1.0, top_p=0.9), seed=0,
                            eos_id=tok.eod, group_size=8)   # out.tokens_BxM, out.lengths_B

``params`` is the GPT's pure dict with its blocks in layer order (``models.to_layers``), on
one device, or on a mesh as :func:`rollout_params` lays out the training mesh's parameters
(gathered once, split over tp; XLA partitions the program from those shardings, and from
the prompts' split over the batch axes, :func:`complete`'s ``batch_sharding``). The batch
is every prompt repeated ``group_size`` times (GRPO's groups).

Layout. Prompts are left-padded to one length P (a shape bucket), so that every sequence's
next token goes to the same cache slot: slot P + t at step t. The cache holds S = P + M
slots per layer (M = ``max_new_tokens``), keys and values [units, B, S, K, H] with K the
key/value heads (grouped-query attention keeps K < N). A sequence with ``pad`` padding
slots has its token at slot s at rotary position s − pad (so positions start at 0, as
transformers' ``generate`` numbers left-padded prompts) and attends to the slots
``pad <= j <= s``; a padding slot attends to itself only (its output is never read, and
an empty softmax would give NaN). The rotary embedding is relative, so the offset changes
no logit; it keeps the numbers those of transformers.

One compiled program per (B, P, M, sampling) (eos is an argument): the prefill, then a ``lax.while_loop`` that
samples a token from the last logits, stores it, and runs the model on it (T = 1) with
:meth:`models.gpt.Attention.cached`, until every sequence has written ``eos_id`` or M
tokens. A finished sequence writes ``pad_id`` from then on.

Sampling (the order transformers applies its warpers): logits / temperature, then the
``top_k`` largest kept, then the smallest set of the likeliest tokens whose probability
reaches ``top_p`` (the softmax of what top-k kept); temperature 0 is greedy. The
vocabulary's padding rows are never drawn.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import GPTConfig
from models.gpt import KVCache, rotary_tables
from models.sharding import Parallelism, param_specs, to_layers


class Sampling(NamedTuple):
  """How the next token is chosen: ``temperature`` 0 is greedy (argmax); else drawn
  from softmax(logits / temperature) after ``top_k`` (None: all) and ``top_p`` (1: all)."""
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float = 1.0


class Completions(NamedTuple):
  """What :func:`generate` wrote.

  Attributes:
    tokens_BxM: int32, the new tokens, ``pad_id`` after a sequence's eos.
    logprobs_BxM: float32, each token's log-probability under softmax(logits / T) (T = 1
      when greedy), before top-k/top-p (the policy's log-probability GRPO uses); 0 after
      the end.
    lengths_B: int32, tokens written by each sequence, its eos included.
  """
  tokens_BxM: jax.Array
  logprobs_BxM: jax.Array
  lengths_B: jax.Array


def init_cache(cfg: GPTConfig, batch: int, slots: int) -> tuple[jax.Array, jax.Array]:
  """Zero keys and values [units, (moe_every,) B, S, K, H] in the compute dtype."""
  shape = (cfg.num_layers // cfg.group_size, *((cfg.group_size,) if cfg.group_size > 1 else ()),
           batch, slots, cfg.kv_heads, cfg.head_dim)
  return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


def cache_bytes(cfg: GPTConfig, batch: int, slots: int) -> int:
  """Bytes of :func:`init_cache`'s keys and values."""
  return 2 * batch * slots * cfg.num_layers * cfg.kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def forward(graphdef: Any, params: Any, tokens_BxT: jax.Array, pad_B: jax.Array, start: jax.Array,
            cache: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """The model on T tokens at slots ``[start, start + T)`` of left-padded sequences (``pad_B``
  padding slots each): the last token's logits, float32 [B, padded vocab], and the cache
  with the T tokens' keys and values stored."""
  par = Parallelism()
  model = nnx.merge(graphdef, params)
  B, T = tokens_BxT.shape
  S = cache[0].shape[-3]
  slots_T = start + jnp.arange(T)
  rope = rotary_tables(model.cfg, jnp.maximum(slots_T[None, :] - pad_B[:, None], 0))
  slot_S = jnp.arange(S)
  behind_BxTxS = (slot_S[None, None, :] <= slots_T[None, :, None]) & (slot_S[None, None, :] >= pad_B[:, None, None])
  visible_BxTxS = behind_BxTxS | (slot_S[None, None, :] == slots_T[None, :, None])
  block_graphdef = nnx.graphdef(model.blocks)
  grouped = cache[0].ndim == 6

  # Each unit's cache is scanned over, not carried: a carried cache, read and updated in
  # one iteration, was copied whole (every layer's) several times per layer and token.
  def unit(x_BxTxD, layer):
    i, k_unit, v_unit = layer
    block = nnx.merge(block_graphdef, jax.tree.map(lambda stack: stack[i], params["blocks"]))
    x_BxTxD, aux = block(x_BxTxD, rope, par, cache=KVCache(k_unit, v_unit, start, visible_BxTxS))
    where = (*((0,) if grouped else ()), 0, start, 0, 0)
    k_new, v_new = aux["kv"]
    k_unit = jax.lax.dynamic_update_slice(k_unit, k_new.astype(k_unit.dtype), where)
    v_unit = jax.lax.dynamic_update_slice(v_unit, v_new.astype(v_unit.dtype), where)
    return x_BxTxD, (k_unit, v_unit)

  x_BxTxD = model.embed_tokens(tokens_BxT, par)
  x_BxTxD, (k_all, v_all) = jax.lax.scan(unit, x_BxTxD, (jnp.arange(cache[0].shape[0]), *cache))
  return model.logits(x_BxTxD[:, -1:], par)[:, 0], (k_all, v_all)


def rollout_params(params: Any, par: Parallelism) -> Any:
  """Parameters laid out like ``models.init(cfg, par)``'s (blocks in stages, sharded on
  ``par.mesh``) as :func:`generate` takes them: blocks in layer order, every leaf gathered
  over the mesh's other axes and still split over tp (query and key/value heads, the MLP's
  hidden units, the vocabulary). One all-gather per rollout, not one per token; XLA
  partitions the sampler over tp from these shardings."""
  keep_tp = lambda entry: entry if entry == "tp" or (isinstance(entry, tuple) and "tp" in entry) else None  # noqa: E731

  def sharding(path, spec):
    entries = tuple(spec)[1:] if str(getattr(path[0], "key", path[0])) == "blocks" else tuple(spec)
    return jax.sharding.NamedSharding(par.mesh, jax.sharding.PartitionSpec(*map(keep_tp, entries)))

  blocks = _to_layers(params["blocks"], par.pp, par.virtual_stages)
  return jax.device_put(dict(params, blocks=blocks), jax.tree_util.tree_map_with_path(sharding, param_specs(params)))


_to_layers = jax.jit(to_layers, static_argnums=(1, 2))


def warp(logits_BxV: jax.Array, sampling: Sampling, vocab_size: int) -> jax.Array:
  """The logits the next token is drawn from (module docstring): / temperature, top-k,
  top-p; -inf for the tokens left out and the vocabulary's padding rows."""
  logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < vocab_size, logits_BxV, -jnp.inf)
  logits_BxV = logits_BxV / sampling.temperature
  if sampling.top_k is not None:
    kth_B1 = jax.lax.top_k(logits_BxV, min(sampling.top_k, vocab_size))[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV >= kth_B1, logits_BxV, -jnp.inf)
  if sampling.top_p < 1:
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # the likelier tokens' total
    lowest_B1 = jnp.min(jnp.where(before_BxV < sampling.top_p, sorted_BxV, jnp.inf), -1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV >= lowest_B1, logits_BxV, -jnp.inf)
  return logits_BxV


def _choose(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling, vocab_size: int
            ) -> tuple[jax.Array, jax.Array]:
  """The next token [B] and its log-probability under softmax(logits / T) [B]."""
  real_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < vocab_size, logits_BxV, -jnp.inf)
  if sampling.temperature == 0:
    token_B = jnp.argmax(real_BxV, -1)
    logprobs_BxV = jax.nn.log_softmax(real_BxV, -1)
  else:
    token_B = jax.random.categorical(key, warp(logits_BxV, sampling, vocab_size), -1)
    logprobs_BxV = jax.nn.log_softmax(real_BxV / sampling.temperature, -1)
  return token_B.astype(jnp.int32), jnp.take_along_axis(logprobs_BxV, token_B[:, None], -1)[:, 0]


def generate(graphdef: Any, params: Any, prompts_BxP: jax.Array, lengths_B: jax.Array, key: jax.Array, *,
             max_new_tokens: int, sampling: Sampling = Sampling(), eos_id: int | None = None,
             pad_id: int = 0) -> Completions:
  """Completions of left-padded prompts (int [B, P], each row's last ``lengths_B`` tokens
  its prompt, lengths >= 1), ``max_new_tokens`` at most, stopping at ``eos_id`` (None:
  never). Compiled once per shape and sampling (not per eos); see the module docstring."""
  return _generate(graphdef, params, prompts_BxP, lengths_B, key, jnp.int32(-1 if eos_id is None else eos_id),
                   max_new_tokens=max_new_tokens, sampling=sampling, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "pad_id"))
def _generate(graphdef: Any, params: Any, prompts_BxP: jax.Array, lengths_B: jax.Array, key: jax.Array,
              eos_id: jax.Array, *, max_new_tokens: int, sampling: Sampling, pad_id: int) -> Completions:
  state = _prefill(graphdef, params, prompts_BxP, lengths_B, max_new_tokens, pad_id)
  return _decode(graphdef, params, state, key, eos_id, jnp.int32(max_new_tokens), sampling, pad_id).out


class _State(NamedTuple):
  """The decoding loop's carry: ``t`` tokens written of ``out``, the next token's logits,
  the cache, the sequences done, and each one's padding slots."""
  t: jax.Array
  out: Completions
  logits_BxV: jax.Array
  cache: tuple[jax.Array, jax.Array]
  done_B: jax.Array
  pad_B: jax.Array


def _prefill(graphdef: Any, params: Any, prompts_BxP: jax.Array, lengths_B: jax.Array, max_new_tokens: int,
             pad_id: int) -> _State:
  """The prompts run once into a cache of P + ``max_new_tokens`` slots; nothing written yet."""
  cfg = nnx.merge(graphdef, params).cfg
  B, P = prompts_BxP.shape
  M = max_new_tokens
  pad_B = (P - lengths_B).astype(jnp.int32)
  logits_BxV, cache = forward(graphdef, params, prompts_BxP, pad_B, jnp.int32(0), init_cache(cfg, B, P + M))
  out = Completions(jnp.full((B, M), pad_id, jnp.int32), jnp.zeros((B, M), jnp.float32), jnp.zeros(B, jnp.int32))
  return _State(jnp.int32(0), out, logits_BxV, cache, jnp.zeros(B, bool), pad_B)


def _decode(graphdef: Any, params: Any, state: _State, key: jax.Array, eos_id: jax.Array, stop: jax.Array,
            sampling: Sampling, pad_id: int) -> _State:
  """Tokens ``state.t`` to ``stop`` (fewer where every sequence has ended): each step
  samples a token from the last logits (keyed by its position t), stores it and runs the
  model on it."""
  vocab_size = nnx.merge(graphdef, params).cfg.vocab_size
  P = state.cache[0].shape[-3] - state.out.tokens_BxM.shape[1]

  def body(state: _State) -> _State:
    t, out, logits_BxV, cache, done_B, pad_B = state
    token_B, logprob_B = _choose(logits_BxV, jax.random.fold_in(key, t), sampling, vocab_size)
    token_B = jnp.where(done_B, pad_id, token_B)
    out = Completions(out.tokens_BxM.at[:, t].set(token_B),
                      out.logprobs_BxM.at[:, t].set(jnp.where(done_B, 0.0, logprob_B)),
                      out.lengths_B + (~done_B).astype(jnp.int32))
    done_B = done_B | (token_B == eos_id)  # eos_id -1: never
    logits_BxV, cache = forward(graphdef, params, token_B[:, None], pad_B, P + t, cache)
    return _State(t + 1, out, logits_BxV, cache, done_B, pad_B)

  return jax.lax.while_loop(lambda state: (state.t < stop) & ~jnp.all(state.done_B), body, state)


_prefill_jit = jax.jit(_prefill, static_argnames=("graphdef", "max_new_tokens", "pad_id"))
_decode_jit = jax.jit(_decode, static_argnames=("graphdef", "sampling", "pad_id"), donate_argnames="state")


def stream(graphdef: Any, params: Any, prompt_P: np.ndarray, max_new_tokens: int, sampling: Sampling = Sampling(),
           seed: int = 0, eos_id: int | None = None, chunk: int = 16) -> Iterator[np.ndarray]:
  """:func:`complete`'s tokens for one prompt (int [P], P >= 1), ``chunk`` at a time as
  they are written (int32 [<= chunk] each, up to and with ``eos_id``), so that a caller can
  show them and a Ctrl-C stops within a chunk: the same prefill and steps, each token keyed
  by its position as there, run ``chunk`` steps per call."""
  prompts_BxP, lengths_B = left_pad([prompt_P], bucket(len(prompt_P)))
  state = _prefill_jit(graphdef, params, prompts_BxP, lengths_B, max_new_tokens=max_new_tokens, pad_id=0)
  key, eos = jax.random.key(seed), jnp.int32(-1 if eos_id is None else eos_id)
  written = 0
  while written < max_new_tokens:
    state = _decode_jit(graphdef, params, state, key, eos, jnp.int32(min(written + chunk, max_new_tokens)),
                        sampling, 0)
    end = int(state.out.lengths_B[0])
    yield np.asarray(state.out.tokens_BxM[0, written:end])
    if end < min(written + chunk, max_new_tokens):  # the sequence ended (eos)
      return
    written = end


def bucket(length: int, smallest: int = 16) -> int:
  """The padded prompt length: the next power of two from ``smallest``, so that a few
  compiled programs serve every prompt length."""
  return max(smallest, 1 << math.ceil(math.log2(max(length, 1))))


def left_pad(prompts: list[np.ndarray], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Prompts (int [P_i], each P_i in [1, length]) left-padded to ``length``: int32
  [len(prompts), length] and their lengths, int32."""
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  out = np.full((len(prompts), length), pad_id, np.int32)
  for row, prompt in zip(out, prompts):
    row[length - len(prompt):] = prompt
  return out, lengths


def complete(graphdef: Any, params: Any, prompts: list[np.ndarray], max_new_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0, eos_id: int | None = None,
             group_size: int = 1, pad_id: int = 0, batch_sharding: jax.sharding.Sharding | None = None
             ) -> Completions:
  """Each prompt's ``group_size`` completions, rows ``[i·G, (i+1)·G)`` for prompt i, the
  prompts left-padded to a :func:`bucket` (module docstring). With ``batch_sharding`` (the
  training batch's, over the mesh's batch axes) each device samples its share of the rows:
  XLA partitions the prefill, the cache and the loop from it (the tokens are those of one
  device: the sampler's draws are keyed by position, not by device)."""
  prompts_BxP, lengths_B = left_pad(prompts, bucket(max(len(p) for p in prompts)), pad_id)
  prompts_BxP, lengths_B = np.repeat(prompts_BxP, group_size, 0), np.repeat(lengths_B, group_size)
  if batch_sharding is not None:
    prompts_BxP, lengths_B = jax.device_put((prompts_BxP, lengths_B), batch_sharding)
  return generate(graphdef, params, prompts_BxP, lengths_B, jax.random.key(seed), max_new_tokens=max_new_tokens,
                  sampling=sampling, eos_id=eos_id, pad_id=pad_id)
