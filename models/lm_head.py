"""The LM head and what the losses read of its logits, in chunks of tokens.

Per token, the losses need three numbers of the logits z = h·W (float32, the vocabulary
V over tp): the target's logit z_t, the log-sum-exp lse(z) and, for an entropy, the
softmax's mean logit Σ p·z. Formed for every token at once, the logits, their softmax
and their gradient are each a [B, T, V/tp] float32 buffer (``small``'s vocabulary of
50,304 made 631-640 MiB of its 1,444 MiB of temporaries, docs/planning.md). With
``GPTConfig.loss_chunk`` = C > 0 each device's tokens go through the head C at a time
in a scan whose body is checkpointed: the forward pass keeps the three [C] numbers of
each chunk, the backward pass forms the chunk's logits again, so the peak holds one
chunk's [C, V/tp] buffers, at the cost of the head's product done twice (its forward
flops, 2·C·D·V/tp per chunk, once more).

The target's logit is a comparison of the vocabulary's ids with the target, summed over
the (tp-sharded) vocabulary: each tp rank contributes its own ids' logits and the sum
reduces over tp as [C] partial results, so the vocabulary is never gathered.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dion_jax import parallel
from models.sharding import Parallelism


class HeadTerms(NamedTuple):
  """Per-token numbers of the logits z / temperature, float32, each [B, T].

  Attributes:
    target: the target's logit (0 where the target is -1).
    normalizer: the log-sum-exp over the vocabulary.
    mean_logit: Σ softmax · logit over the vocabulary (its entropy is normalizer −
      mean_logit), or None when not asked for.
  """
  target: jax.Array
  normalizer: jax.Array
  mean_logit: jax.Array | None


def vocab_logits(h_BxTxD: jax.Array, head_DxV: jax.Array, par: Parallelism, vocab_size: int | None) -> jax.Array:
  """float32 logits [B, T, V] of the normed ``h`` (compute dtype) and the head [D, V]
  (float32, vocab-parallel over tp), their product in ``h``'s dtype; -inf on the padding
  ids (>= ``vocab_size``) unless ``vocab_size`` is None."""
  logits_BxTxV = par.constrain((h_BxTxD @ head_DxV.astype(h_BxTxD.dtype)).astype(jnp.float32),
                               "batch", None, "vocab")
  if vocab_size is None:
    return logits_BxTxV
  return jnp.where(jnp.arange(logits_BxTxV.shape[-1]) < vocab_size, logits_BxTxV, -jnp.inf)


def head_terms(h_BxTxD: jax.Array, head_DxV: jax.Array, targets_BxT: jax.Array, par: Parallelism, *,
               vocab_size: int | None, chunk: int, temperature: float = 1.0, entropy: bool = False) -> HeadTerms:
  """:class:`HeadTerms` of the logits of ``h`` [B, T, D] (normed, compute dtype) and the
  head [D, V] (float32), at ``temperature``, the padding ids left out unless
  ``vocab_size`` is None (as :func:`vocab_logits`), ``chunk`` tokens per device at a time (0:
  all at once; module docstring).

  The chunks split each device's B/d · T tokens (d the data-parallel shards of the batch
  axes, 1 when they do not divide B), the last one padded with tokens that count nothing,
  so that a chunk never takes tokens from another device and ``chunk`` need not divide
  the token count.
  """

  def terms(h_xD, targets_x):
    z_xV = vocab_logits(h_xD, head_DxV, par, vocab_size)
    if temperature != 1.0:
      z_xV = z_xV / temperature
    ids_V = jnp.arange(z_xV.shape[-1])
    # where, not a product with a one-hot: a -inf padding logit times 0 would be NaN.
    target_x = jnp.sum(jnp.where(ids_V == targets_x[..., None], z_xV, 0.0), -1)
    normalizer_x = jax.nn.logsumexp(z_xV, -1)
    if not entropy:
      return HeadTerms(target_x, normalizer_x, None)
    probs_xV = jnp.exp(z_xV - normalizer_x[..., None])
    finite_xV = z_xV if vocab_size is None else jnp.where(ids_V < vocab_size, z_xV, 0.0)
    return HeadTerms(target_x, normalizer_x, jnp.sum(probs_xV * finite_xV, -1))

  B, T, D = h_BxTxD.shape
  shards = _batch_shards(par, B)
  tokens = B // shards * T  # each device's
  if not chunk or chunk >= tokens:
    return terms(h_BxTxD, targets_BxT)
  n = math.ceil(tokens / chunk)
  pad = n * chunk - tokens

  def chunked(x_BxTx, fill):  # [B, T, ...] -> [n, shards, chunk, ...], each device's tokens in order
    x_dxNx = x_BxTx.reshape(shards, tokens, *x_BxTx.shape[2:])
    x_dxNx = jnp.pad(x_dxNx, [(0, 0), (0, pad)] + [(0, 0)] * (x_BxTx.ndim - 2), constant_values=fill)
    x_nxdxCx = jnp.swapaxes(x_dxNx.reshape(shards, n, chunk, *x_BxTx.shape[2:]), 0, 1)
    return par.constrain(x_nxdxCx, None, "batch", *(None,) * (x_nxdxCx.ndim - 2))

  out = jax.lax.map(lambda xs: jax.checkpoint(terms, prevent_cse=False)(*xs),
                    (chunked(h_BxTxD, 0), chunked(targets_BxT, -1)))

  def unchunked(x_nxdxC):
    return jnp.swapaxes(x_nxdxC, 0, 1).reshape(shards, n * chunk)[:, :tokens].reshape(B, T)

  return jax.tree.map(unchunked, out)


def _batch_shards(par: Parallelism, batch: int) -> int:
  """How many shards the batch axes (those not manual here) split a batch of ``batch``
  sequences into; 1 when they do not divide it."""
  axes = parallel.axis_names(*par.spec("batch")) if par.mesh is not None else ()
  shards = math.prod(par.size(a) for a in axes)
  return shards if batch % shards == 0 else 1
