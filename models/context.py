"""Context parallelism: every sequence split over the mesh axis ``cp``, attention included.

To the parameters cp is one more data-parallel axis (stored sharded over it as over fs,
gathered where used, gradients reduce-scattered back: ``models.sharding``); to the
activations it is a split of the sequence. ``models.loss`` runs the whole model in a
``shard_map`` manual over cp (as the pipeline runs in one manual over pp):
embedding, norms, MLPs, LM head and loss are per token and run on the rank's own T/cp
tokens as they are; only attention needs the other ranks' keys and values.

Causal load balancing. The T tokens are cut into 2·cp chunks of C = T/(2·cp); rank i holds
chunks i and 2·cp − 1 − i (Megatron CP's layout), so every rank holds the same number of
(query, key) pairs under the causal mask, C·(2·cp·C + 1) of them, instead of rank cp − 1
holding most. :func:`balance` reorders a [B, T] array so that an even split of its sequence
over cp gives this layout; :func:`positions` are the held tokens' positions, which set the
rotary angles and the causal mask. The loss is a mean over all tokens, so the order does
not change it.

Attention scheme: all-gather of K/V (MaxText's default, Llama 3's context parallelism).
Each rank gathers the keys and values of the whole sequence, [B, T, K, H] with K kv heads,
and attends its T/cp queries to them under the mask ``pos_q >= pos_k``: scores are
(T/cp × T) per head, never (T × T). The backward pass gathers K/V again (only matrix
products are saved) and reduce-scatters dK and dV. Chosen over the ring (K/V blocks passed
by ``ppermute`` with an online softmax, Megatron CP) by measurement against a ring
prototype (``benchmarks/context_memory.py``, GPT small, T = 4096, cp = 2, per layer and
device): both send the same bytes, 36 MiB (all-gather: 2 gathers forward, 2 again
backward, 2 reduce-scatters; ring: 6 collective-permutes of one block), and the ring's
compiled step holds more temporaries (4435 against 4231 MiB), since autodiff of the ring
keeps every received block; its memory advantage needs a hand-written backward pass that
re-circulates K/V. The all-gather also keeps one function for XLA and cuDNN
(``jax.nn.dot_product_attention`` with a mask; a ring needs each block's log-sum-exp and
its gradient), and takes the segment ids of packed sequences (a mask term) and fewer kv
heads (which shrink the gathered bytes by N/K) as they come. What it gives up is overlap:
a ring hides each block's transfer behind the previous block's compute. cuDNN with an
explicit mask also computes the masked half of the (T/cp × T) block, where its causal
mode skips it (cp = 1 keeps that mode).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models import sharding

AXIS = "cp"


def check_seq_len(seq_len: int, cp: int) -> None:
  """Raises a one-line ValueError when ``seq_len`` does not split into 2·cp chunks (cp > 1;
  without context parallelism any length goes)."""
  if cp > 1 and seq_len % (2 * cp):
    raise ValueError(
        f"sequence length {seq_len} does not split into 2·cp = {2 * cp} chunks for context"
        f" parallelism cp={cp}; choose a sequence length that is a multiple of {2 * cp}")


def token_order(seq_len: int, cp: int) -> np.ndarray:
  """Position of the token at each slot of the balanced layout, int [seq_len].

  Slots ``[r·T/cp, (r+1)·T/cp)`` belong to rank r: chunk r, then chunk 2·cp − 1 − r.
  """
  check_seq_len(seq_len, cp)
  C = seq_len // (2 * cp)
  chunks = np.stack([np.arange(cp), 2 * cp - 1 - np.arange(cp)], 1).reshape(-1)
  return (chunks[:, None] * C + np.arange(C)).reshape(-1)


def balance(x_BxT: jax.Array, cp: int) -> jax.Array:
  """``x`` with its sequence (axis 1) in the balanced layout: split it evenly over cp."""
  return x_BxT if cp == 1 else x_BxT[:, token_order(x_BxT.shape[1], cp)]


def positions(seq_len: int, cp: int) -> jax.Array:
  """Positions of this rank's tokens, int32 [seq_len / cp]; inside a shard_map manual
  over cp when cp > 1."""
  if cp == 1:
    return jnp.arange(seq_len, dtype=jnp.int32)
  local = seq_len // cp
  order = jnp.asarray(token_order(seq_len, cp), jnp.int32)
  return jax.lax.dynamic_slice_in_dim(order, jax.lax.axis_index(AXIS) * local, local)


def _gather(x_BxTx: jax.Array, cp: int, spec: P | None) -> jax.Array:
  """The whole sequence of a per-rank array (axis 1), in the balanced layout; ``spec``:
  its layout over the automatic mesh axes, which the gather keeps (``sharding.in_auto_axes``)."""
  if cp == 1:
    return x_BxTx
  gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1, tiled=True)  # noqa: E731
  return gather(x_BxTx) if spec is None else sharding.in_auto_axes(gather, spec, spec)(x_BxTx)


def _visible(T_local: int, cp: int, segment_ids_BxT: jax.Array | None, spec: P | None = None) -> jax.Array:
  """Which keys of the whole sequence each of this rank's queries attends to, bool
  [B or 1, 1, T/cp, T]: causal by position, and within its segment when packed."""
  T = T_local * cp
  pos_q_T = positions(T, cp)
  pos_k_S = jnp.asarray(token_order(T, cp) if cp > 1 else np.arange(T), jnp.int32)
  mask_BxNxTxS = (pos_q_T[:, None] >= pos_k_S[None, :])[None, None]
  if segment_ids_BxT is not None:
    seg_k_BxS = _gather(segment_ids_BxT, cp, None if spec is None else P(spec[0], None))
    mask_BxNxTxS = mask_BxNxTxS & (segment_ids_BxT[:, None, :, None] == seg_k_BxS[:, None, None, :])
  return mask_BxNxTxS


def attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array, *,
              implementation: str, cp: int, segment_ids_BxT: jax.Array | None = None,
              spec: P | None = None) -> jax.Array:
  """Causal attention of this rank's queries to the whole sequence, [B, T, N, H].

  ``T`` is the rank's share of the sequence (all of it when cp = 1), in the balanced
  layout. With cp > 1 (inside a ``shard_map`` manual over cp) keys, values and segment
  ids are all-gathered over cp and the causal mask compares positions. ``K`` kv heads
  may be fewer than the ``N`` query heads (grouped-query attention, N a multiple of K).

  Args:
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH: queries, keys, values of this rank's tokens.
    implementation: ``"xla"`` or ``"cudnn"``, as for ``jax.nn.dot_product_attention``.
    cp: the size of the mesh axis ``cp``.
    segment_ids_BxT: packed sequences: a token attends only to its own segment's tokens.
    spec: the keys' and values' PartitionSpec over the mesh axes left automatic (batch,
      heads), kept by the gathers over cp; None replicates them over those axes first.
  """
  if cp == 1 and segment_ids_BxT is None:
    # cuDNN's causal mode skips the masked half of the scores.
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                        implementation=implementation)
  mask_BxNxTxS = _visible(q_BxTxNxH.shape[1], cp, segment_ids_BxT, spec)
  return jax.nn.dot_product_attention(q_BxTxNxH, _gather(k_BxTxKxH, cp, spec), _gather(v_BxTxKxH, cp, spec),
                                      mask=mask_BxNxTxS, implementation=implementation)


def logit_max(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, *, cp: int,
              segment_ids_BxT: jax.Array | None = None, spec: P | None = None) -> jax.Array:
  """Each query head's largest logit q·k/sqrt(H) over the keys :func:`attention` lets it
  see, float32 [N], over the whole batch and sequence (a pmax over cp), for QK-clip
  (``models/qk_clip.py``). The scores are formed again, outside the attention kernel
  (cuDNN's never leave it), without a gradient. Query head n reads key head n // (N/K),
  as in ``jax.nn.dot_product_attention``; ``spec`` as for :func:`attention`."""
  B, T, N, H = q_BxTxNxH.shape
  k_BxSxKxH = _gather(jax.lax.stop_gradient(k_BxTxKxH), cp, spec).astype(jnp.float32)
  K = k_BxSxKxH.shape[2]
  q_BxTxKxGxH = jax.lax.stop_gradient(q_BxTxNxH).astype(jnp.float32).reshape(B, T, K, N // K, H)
  s_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH) / np.sqrt(H)
  mask = _visible(T, cp, segment_ids_BxT, spec)[:, :, None]
  logits_N = jnp.max(jnp.where(mask, s_BxKxGxTxS, -jnp.inf), axis=(0, 3, 4)).reshape(N)
  return jax.lax.pmax(logits_N, AXIS) if cp > 1 else logits_N
