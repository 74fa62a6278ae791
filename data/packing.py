"""Packed rows: examples laid end to end into rows of ``seq_len`` positions, as fine-tuning
(``data/sft.py``) and GRPO's update (``train/grpo/batch.py``) feed the model.

    row_E, start_E = next_fit(lengths_E, seq_len)          # or first_fit_decreasing
    rows = fill(inputs, targets, row_E, start_E, R, seq_len)

Besides ``inputs`` and ``targets``, each row carries ``segment_ids`` (1, 2, ... for its
examples, 0 for the padding at its end: attention stays within a segment,
``models/gpt.py``) and ``positions`` (each token's position within its own example, for
the rotary embedding), so that a packed row gives each example the loss it would have
alone. Padding has inputs 0 and targets -1 (not counted).

Two placements: :func:`next_fit` keeps the examples' order (a fine-tuning file's order is
its data order); :func:`first_fit_decreasing` takes the longest first, each into the first
row with room, for fewer rows where the order does not matter (the terms of one loss).
"""
from __future__ import annotations

import numpy as np


def next_fit(lengths_E: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Each example's row and first position, int [E] each: in order, a new row when the
  next example does not fit the current one. Every length is at most ``seq_len``."""
  row_E, start_E = np.zeros(len(lengths_E), np.int64), np.zeros(len(lengths_E), np.int64)
  row, used = -1, seq_len
  for e, length in enumerate(lengths_E):
    if used + length > seq_len:
      row, used = row + 1, 0
    row_E[e], start_E[e] = row, used
    used += length
  return row_E, start_E


def first_fit_decreasing(lengths_E: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Each example's row and first position, int [E] each: the longest first, each into the
  first row it fits (at most 11/9 of the fewest rows, plus one). Lengths at most ``seq_len``."""
  row_E, start_E = np.zeros(len(lengths_E), np.int64), np.zeros(len(lengths_E), np.int64)
  free_R = np.full(len(lengths_E), seq_len)  # room left in each row; never more rows than examples
  for e in np.argsort(-np.asarray(lengths_E), kind="stable"):
    row = int(np.argmax(free_R >= lengths_E[e]))
    row_E[e], start_E[e] = row, seq_len - free_R[row]
    free_R[row] -= lengths_E[e]
  return row_E, start_E


def fill(inputs: list[np.ndarray], targets: list[np.ndarray], row_E: np.ndarray, start_E: np.ndarray, rows: int,
         seq_len: int) -> dict[str, np.ndarray]:
  """``rows`` rows of ``seq_len`` positions (module docstring), int32 [rows, seq_len] each
  of ``inputs``, ``targets``, ``segment_ids``, ``positions``: example e's inputs and targets
  at row ``row_E[e]`` from ``start_E[e]``, its segment the row's next."""
  out = {k: np.zeros((rows, seq_len), np.int32) for k in ("inputs", "segment_ids", "positions")}
  out["targets"] = np.full((rows, seq_len), -1, np.int32)
  segments_R = np.zeros(rows, np.int32)
  for e in np.lexsort((start_E, row_E)):  # each row's examples in their order along it
    r, span = row_E[e], slice(start_E[e], start_E[e] + len(inputs[e]))
    segments_R[r] += 1
    out["inputs"][r, span], out["targets"][r, span] = inputs[e], targets[e]
    out["segment_ids"][r, span] = segments_R[r]
    out["positions"][r, span] = np.arange(len(inputs[e]))
  return out
