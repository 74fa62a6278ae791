"""The validation loss, one definition for the trainer and ``python -m train.eval``.

    rows_RxT = evaluation.rows(source, seq_len, eval_tokens, eod)
    loss, targets = evaluation.mean_loss(loss_sum, params, rows_RxT, batch_size, sharding)

The rows [R, T] (:func:`rows`: a fine-tuning file's packed examples, or the first
``eval_tokens // T`` windows of a token source) are read in order, ``batch_size`` at a time, each exactly once; the last batch is
filled up with padding rows (inputs 0, targets -1), so every batch has one compiled shape
and no row is dropped or repeated. Each batch's token losses are summed over its counted
targets (those >= 0: not a prompt, not padding) in float32, the sums added in float64,
and the total divided by the number of counted targets of all rows:

    loss = sum over rows r, positions t with targets[r, t] >= 0 of -log p(targets[r, t])
           / #{(r, t): targets[r, t] >= 0}

the mean token loss over every learned target, not a mean of per-batch means (a batch
with few learned targets weighs what it holds).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Sharding

import data


def rows(source: Any, seq_len: int, eval_tokens: int, eod: int | None = None) -> dict[str, np.ndarray]:
  """The validation rows of ``source`` (``data.load_source``'s), int32 [R, seq_len] each:
  every packed row of a fine-tuning file, or of token data the first
  R = max(1, eval_tokens // seq_len) windows in order (``data.ordered_rows``: window i of
  a stream holds its tokens [i·T, i·T + T], T = seq_len, the inputs then the targets
  shifted by one; a window never crosses from one stream to the next), R·T targets: with
  ``--eval-tokens 16384`` and T = 128, 128 windows and 16384 targets. ``eod``: with
  ``--document-mask``, the windows carry segment ids and positions as in training."""
  limit = None if isinstance(source, data.SFTSource) else max(1, eval_tokens // seq_len)
  return data.ordered_rows(source, seq_len=seq_len, limit=limit, eod=eod)


def mean_loss(loss_sum: Callable[[Any, dict], jax.Array], params: Any, rows_RxT: dict[str, np.ndarray],
              batch_size: int, sharding: Sharding) -> tuple[float, int]:
  """``(mean token loss, counted targets)`` of ``rows_RxT`` (module docstring).

  Args:
    loss_sum: ``(params, batch) -> float32 scalar``, the summed loss of a batch's counted
      targets (``train.run.step.make_eval_step``).
    params: the model's parameters.
    rows_RxT: int arrays [R, T]: "inputs", "targets" (-1: not counted), and optionally
      "segment_ids" and "positions"; every process holds all of them.
    batch_size: rows per call of ``loss_sum``.
    sharding: of a batch [batch_size, T] (each process places its own slices).
  """
  total, count = 0.0, 0
  for start in range(0, len(rows_RxT["inputs"]), batch_size):
    batch = {k: v[start:start + batch_size] for k, v in rows_RxT.items()}
    pad = batch_size - len(batch["inputs"])
    batch = {k: np.pad(v, ((0, pad), (0, 0)), constant_values=-1 if k == "targets" else 0).astype(np.int32)
             for k, v in batch.items()}
    count += int(np.sum(batch["targets"] >= 0))
    batch = {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
             for k, v in batch.items()}
    total += float(loss_sum(params, batch))
  return total / max(count, 1), count
