"""The LM head and what the losses read of its logits, in chunks of tokens.

Per token, the losses need three numbers of the logits z = h·W (float32, the vocabulary
V over tp): the target's logit z_t, the log-sum-exp lse(z) and, for an entropy, the
softmax's mean logit Σ p·z. Formed for every token at once, the logits, their softmax
and their gradient are each a [B, T, V/tp] float32 buffer (``small``'s vocabulary of
50,304 made 631-640 MiB of its 1,444 MiB of temporaries, docs/planning.md). With
``GPTConfig.loss_chunk`` = C > 0 each device's tokens go through the head C at a time
in a scan that keeps the three [C] numbers of each chunk; the backward pass is a second
scan that forms each chunk's logits again and takes their gradient, so the peak holds
one chunk's [C, V/tp] buffers, at the cost of the head's product done twice (its forward
flops, 2·C·D·V/tp per chunk, once more: small's width with 2 layers, one CPU device,
9-18% more step time).

The target's logit is a comparison of the vocabulary's ids with the target, summed over
the (tp-sharded) vocabulary: each tp rank contributes its own ids' logits and the sum
reduces over tp as [C] partial results, so the vocabulary is never gathered.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dion_jax import parallel
from models.sharding import LOGICAL_AXES, Parallelism, in_auto_axes


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
  axes), the last one padded with tokens that count nothing, so ``chunk`` need not divide
  them. Both scans run in a ``shard_map`` manual over every axis still automatic, the
  vocabulary's reductions written out over tp: each device sums its own chunks' head
  gradient and the devices' sums are reduced once, where the partitioner all-reduced the
  partial sum over the batch axes after every chunk (tiny's head on fs=2,tp=2, 16 chunks:
  18.2 MB over fs in place of the unchunked loss's 2.5 MB; now 2.5 MB). A batch those
  axes do not divide is taken whole.
  """

  def terms(h_xD, targets_x, head_DxV, tp=None):
    """On [..., V] logits whole (``tp`` None: the partitioner's), or on this device's
    vocabulary shard of the manual axis ``tp``."""
    if tp is None:
      z_xV, first = vocab_logits(h_xD, head_DxV, par, None), 0
    else:
      z_xV = (h_xD @ head_DxV.astype(h_xD.dtype)).astype(jnp.float32)
      first = jax.lax.axis_index(tp) * z_xV.shape[-1]
    ids_V = first + jnp.arange(z_xV.shape[-1])
    if vocab_size is not None:
      z_xV = jnp.where(ids_V < vocab_size, z_xV, -jnp.inf)
    if temperature != 1.0:
      z_xV = z_xV / temperature
    total = (lambda x: x) if tp is None else (lambda x: jax.lax.psum(x, tp))
    # where, not a product with a one-hot: a -inf padding logit times 0 would be NaN.
    target_x = total(jnp.sum(jnp.where(ids_V == targets_x[..., None], z_xV, 0.0), -1))
    if tp is None:
      normalizer_x = jax.nn.logsumexp(z_xV, -1)
    else:
      max_x = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(z_xV, -1)), tp)
      normalizer_x = max_x + jnp.log(total(jnp.sum(jnp.exp(z_xV - max_x[..., None]), -1)))
    if not entropy:
      return HeadTerms(target_x, normalizer_x, None)
    probs_xV = jnp.exp(z_xV - normalizer_x[..., None])
    finite_xV = z_xV if vocab_size is None else jnp.where(ids_V < vocab_size, z_xV, 0.0)
    return HeadTerms(target_x, normalizer_x, total(jnp.sum(probs_xV * finite_xV, -1)))

  B, T, _ = h_BxTxD.shape
  batch_axes = _batch_axes(par)
  shards = math.prod(par.size(a) for a in batch_axes)
  if not chunk or chunk >= B // shards * T or B % shards:
    return terms(h_BxTxD, targets_BxT, head_DxV)
  tp = LOGICAL_AXES["vocab"] if par.mesh is not None else None

  def chunks(x_bxTx, fill):  # -> [n, chunk, ...]: this device's tokens in order, the last chunk padded
    N = x_bxTx.shape[0] * T
    x_Nx = x_bxTx.reshape(N, *x_bxTx.shape[2:])
    x_Nx = jnp.pad(x_Nx, [(0, -N % chunk)] + [(0, 0)] * (x_Nx.ndim - 1), constant_values=fill)
    return x_Nx.reshape(-1, chunk, *x_Nx.shape[1:])

  def tokens_of(x_nxC, b):
    return x_nxC.reshape(-1)[:b * T].reshape(b, T)

  def local(h_bxTxD, targets_bxT, head_DxV):  # this device's b sequences and vocabulary shard
    out = jax.lax.map(lambda xs: terms(*xs, head_DxV, tp), (chunks(h_bxTxD, 0), chunks(targets_bxT, -1)))
    return jax.tree.map(lambda x: tokens_of(x, h_bxTxD.shape[0]), out)

  def local_grad(h_bxTxD, targets_bxT, head_DxV, ct):
    """The chunks' gradients, each chunk's logits formed again; the head's summed here,
    then over the batch axes once (varying over them, its per-chunk gradient is not
    reduced over them)."""
    head_DxV = jax.lax.pcast(head_DxV, batch_axes, to="varying") if batch_axes else head_DxV

    def step(grad_DxV, xs):
      h_CxD, targets_C, ct_C = xs
      _, vjp = jax.vjp(lambda h, w: terms(h, targets_C, w, tp), h_CxD, head_DxV)
      dh_CxD, dw_DxV = vjp(ct_C)
      return grad_DxV + dw_DxV, dh_CxD

    ct_chunks = jax.tree.map(lambda x: chunks(x, 0), ct)
    grad_DxV, dh_nxCxD = jax.lax.scan(step, jnp.zeros_like(head_DxV),
                                      (chunks(h_bxTxD, 0), chunks(targets_bxT, -1), ct_chunks))
    b, D = h_bxTxD.shape[0], h_bxTxD.shape[2]
    dh_bxTxD = dh_nxCxD.reshape(-1, D)[:b * T].reshape(b, T, D)
    return dh_bxTxD, jax.lax.psum(grad_DxV, batch_axes) if batch_axes else grad_DxV

  if par.mesh is None:
    run, run_grad = local, local_grad
  else:
    tokens = P(batch_axes or None)
    run = in_auto_axes(local, (tokens, tokens, P(None, tp)), tokens)
    run_grad = in_auto_axes(local_grad, (tokens, tokens, P(None, tp), tokens), (tokens, P(None, tp)))

  # Differentiated by hand: the partitioner's jvp of a shard_map nested in cp's or pp's
  # cannot lower the residuals it hands out; here they are the inputs.
  @jax.custom_vjp
  def chunked(h_BxTxD, head_DxV):
    return run(h_BxTxD, targets_BxT, head_DxV)

  def chunked_fwd(h_BxTxD, head_DxV):
    return run(h_BxTxD, targets_BxT, head_DxV), (h_BxTxD, head_DxV)

  def chunked_bwd(residuals, ct):
    h_BxTxD, head_DxV = residuals
    return run_grad(h_BxTxD, targets_BxT, head_DxV, ct)

  chunked.defvjp(chunked_fwd, chunked_bwd)
  return chunked(h_BxTxD, head_DxV)


def _batch_axes(par: Parallelism) -> tuple[str, ...]:
  """The batch axes of more than one device that are not manual here."""
  if par.mesh is None:
    return ()
  return tuple(a for a in parallel.axis_names(*par.spec("batch")) if par.size(a) > 1)
