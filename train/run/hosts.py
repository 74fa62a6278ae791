"""What each process of a multi-host run holds of a global batch, and the host values it
needs from the others.

A global batch's rows are split over the mesh's batch axes: each process computes on the
rows its devices hold. Work that runs on the host, row by row (GRPO decodes and scores its
completions there, ``train/grpo/rollout.py``), is done once per row, by the row's *owner*: the
lowest process holding it (processes that split the model over tp or pp hold the same
rows). What every process then needs is gathered as numbers, never as Python objects.

With one process every row is its own and nothing is sent.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def row_owners(sharding: jax.sharding.Sharding, rows: int) -> np.ndarray:
  """Each row's owner [rows] under ``sharding`` of an array of ``rows`` rows: the lowest
  process among those whose devices hold it."""
  owners = np.full(rows, jax.process_count(), np.int32)
  for device, index in sharding.devices_indices_map((rows,)).items():
    block = np.arange(rows)[index[0]]
    owners[block] = np.minimum(owners[block], device.process_index)
  return owners


def fetch(x: jax.Array) -> np.ndarray:
  """The whole of ``x`` on every process, whichever devices hold its parts (one all-gather
  when other processes hold some)."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_rows(values: np.ndarray, owners: np.ndarray) -> np.ndarray:
  """The rows [rows, ...] every process sees: row ``i`` as its owner computed it. ``values``
  holds this process's rows in their places (the others are ignored). Float64 and other
  dtypes travel as their bytes (JAX computes without 64-bit types), so the rows arrive bit
  for bit."""
  if jax.process_count() == 1:
    return values
  values = np.ascontiguousarray(values)
  words = values.reshape(len(owners), -1).view(np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(words))  # [processes, rows, bytes]
  mine = everyone[owners, np.arange(len(owners))]
  return mine.view(values.dtype).reshape(values.shape)
