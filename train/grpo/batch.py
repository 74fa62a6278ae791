"""GRPO's update batch: a rollout's completions, each after its prompt, in rows for
``models.loss``, with the objective's per-token fields where the completion tokens are
predicted.

    layout = packed(prompts, completions_BxM, lengths_B, seq_len, unit)   # or padded(...)
    old_BxM = token_logps(graphdef, params, layout, temperature)
    batch = update_batch(layout, objective.per_token_fields(old_BxM, ...))

Two layouts of the same tokens; the objective's loss, statistics and gradient are the same
in both up to float32 rounding (``tests/test_train_grpo_batch.py``):

- :func:`padded`: one completion to a row, its prompt left-padded to the rollout's longest
  (a power of two, ``models.generate.bucket``), then ``--max-new-tokens`` completion slots.
- :func:`packed` (the default): each completion with its prompt as one example, laid end to
  end as ``train.gpt --data sft:`` packs fine-tuning examples (``data/packing.py``: segment
  ids keep attention within each, positions restart at each), the longest first into the
  first row with room. Rows as long as the padded layout's (at most the model's
  ``seq_len``), so that a row's attention spans no more than before while the rows are
  fewer: the forward runs over about the rollout's tokens, not over its longest prompt and
  completion once per completion. The rows' count is rounded up to a multiple of ``unit``
  (the data-parallel ranks times the micro-batches, which split the rows) and to one of 8
  sizes per power of two (at most the padded layout's), so that a few compiled steps serve
  a run.

A :class:`Layout` maps each completion token (b, j) to the position of the row that
predicts it (``index_BxM``), so the objective is written once on [B, M] arrays
(``train/grpo/objective.py``): :func:`token_logps` gathers the rows' log-probabilities to
[B, M] and :func:`update_batch` scatters [B, M] fields to the rows.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import models
from data import packing
from models import generate


class Layout(NamedTuple):
  """The update's rows and where each completion token is predicted."""
  batch: dict[str, np.ndarray]  # models.loss's "inputs", "targets", "positions", "segment_ids": int32 [R, T]
  index_BxM: np.ndarray  # int32: row·T + column of the target that is completion token j of b; -1 past its end


def _bucket(rows: int) -> int:
  """``rows`` up to 16, else rounded up to a multiple of 2^(bits − 4): at most 1/8 more,
  8 sizes per power of two."""
  if rows <= 16:
    return rows
  step = 1 << (rows.bit_length() - 4)  # rows in [8·step, 16·step)
  return -(-rows // step) * step


def _padded_length(prompts: list[np.ndarray], M: int, multiple: int) -> int:
  """The padded layout's row: the longest prompt's bucket and M, a multiple of ``multiple``."""
  return -(-(generate.bucket(max(len(p) for p in prompts)) + M) // multiple) * multiple


def packed(prompts: list[np.ndarray], completions_BxM: np.ndarray, lengths_B: np.ndarray, seq_len: int,
           unit: int = 1, multiple: int = 1) -> Layout:
  """Completion b (its first ``lengths_B[b]`` tokens) after ``prompts[b]`` as one example,
  packed into rows as long as :func:`padded`'s, at most ``seq_len`` (a multiple of
  ``multiple`` either way; module docstring); rows a multiple of ``unit``, which divides B.
  Each prompt plus completion is at most ``seq_len`` tokens."""
  B, M = completions_BxM.shape
  row_length = min(_padded_length(prompts, M, multiple), -(-seq_len // multiple) * multiple)
  tokens = [np.concatenate([p, c[:n]]) for p, c, n in zip(prompts, completions_BxM, lengths_B)]
  inputs = [t[:-1] for t in tokens]
  targets = [np.where(np.arange(1, len(t)) >= len(p), t[1:], -1) for t, p in zip(tokens, prompts)]
  row_B, start_B = packing.first_fit_decreasing(np.asarray([len(x) for x in inputs]), row_length)
  rows = min(unit * _bucket(-(-(int(row_B.max()) + 1) // unit)), B)
  first_B = row_B * row_length + start_B + np.asarray([len(p) for p in prompts]) - 1
  index_BxM = np.where(np.arange(M)[None] < lengths_B[:, None], first_B[:, None] + np.arange(M)[None], -1)
  return Layout(packing.fill(inputs, targets, row_B, start_B, rows, row_length), index_BxM.astype(np.int32))


def padded(prompts: list[np.ndarray], completions_BxM: np.ndarray, lengths_B: np.ndarray, multiple: int = 1
           ) -> Layout:
  """Completion b after ``prompts[b]`` left-padded to the longest's bucket, one to a row of
  T = bucket + M positions (right-padded to a multiple of ``multiple``, as cp's 2·cp chunks
  need): the inputs all T tokens, the targets the next token at the T − M − 1 … T − 2 that
  predict a completion token (-1 elsewhere), rotary positions from 0 at the first real
  token, the padding a segment of its own."""
  B, M = completions_BxM.shape
  prompts_BxP, prompt_lengths_B = generate.left_pad(prompts, generate.bucket(max(len(p) for p in prompts)))
  tokens_BxT = np.concatenate([prompts_BxP, completions_BxM], 1).astype(np.int32)
  T, T_padded = tokens_BxT.shape[1], _padded_length(prompts, M, multiple)
  inputs_BxT = np.pad(tokens_BxT, ((0, 0), (0, T_padded - T)))
  slots_BxT = np.arange(T_padded)[None, :] - (prompts_BxP.shape[1] - prompt_lengths_B)[:, None]
  predicts_T = (np.arange(T_padded) >= T - M - 1) & (np.arange(T_padded) < T - 1)
  batch = {"inputs": inputs_BxT, "targets": np.where(predicts_T, np.roll(inputs_BxT, -1, 1), -1).astype(np.int32),
           "positions": np.maximum(slots_BxT, 0).astype(np.int32), "segment_ids": (slots_BxT >= 0).astype(np.int32)}
  index_BxM = np.arange(B)[:, None] * T_padded + T - M - 1 + np.arange(M)[None]
  return Layout(batch, np.where(np.arange(M)[None] < lengths_B[:, None], index_BxM, -1).astype(np.int32))


def _gather(x_RxT: jax.Array, index_BxM: jax.Array) -> jax.Array:
  """x at each completion token's position [B, M], 0 past a completion's end."""
  return jnp.take(x_RxT.ravel(), jnp.where(index_BxM < 0, x_RxT.size, index_BxM), mode="fill", fill_value=0)


def token_logps(graphdef: Any, params: Any, layout: Layout, temperature: float,
                par: models.Parallelism = models.Parallelism(), entropy: bool = False
                ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """log softmax(logits / ``temperature``) of each completion token, float32 [B, M] (0 past
  its end), by the training forward on ``par``'s mesh (``models.token_logps``: pipelined on
  pp, split on cp); parameters laid out as there (blocks in stages). With ``entropy`` also
  the entropy of each of those tokens' distributions [B, M]."""
  out = models.token_logps(graphdef, params, layout.batch, par, temperature, entropy=entropy)
  return jax.tree.map(lambda x_RxT: _gather(x_RxT, layout.index_BxM), out)


def update_batch(layout: Layout, fields_BxM: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """``layout``'s rows with the objective's per-token fields (each [B, M], by
  ``objective.per_token_fields``) at the positions that predict their completion tokens:
  each [R, T], 0 elsewhere ("sequence": -1, no completion)."""
  R, T = layout.batch["inputs"].shape
  index = jnp.where(layout.index_BxM < 0, R * T, layout.index_BxM).ravel()

  def scatter(name, x_BxM):
    empty = jnp.full(R * T, -1 if name == "sequence" else 0, x_BxM.dtype)
    return empty.at[index].set(x_BxM.ravel(), mode="drop").reshape(R, T)

  return {**layout.batch, **{name: scatter(name, x_BxM) for name, x_BxM in fields_BxM.items()}}
