"""The largest token id a data source really holds, to check it against a model's vocabulary.

A format's usual tokenizer says nothing about a file's ids (a FineWeb ``.bin`` may hold
byte ids, or ids past GPT-2's 50257), and an id at or past the embedding's rows trains
silently on a padded row or turns every step NaN: the trainer and ``train.eval``
compare :func:`max_token_id` with the model's vocabulary before they start.

The scan reads every token once (numpy's max over the memory map, about 1 GB/s); the
result is cached per file in ``CACHE_DIR/token_ids.json``, keyed by the file's real
path, size and modification time, so a later run on the same shards costs nothing.
"""
from __future__ import annotations

import json
import os

import numpy as np

from data import corpus
from data.sft import SFTSource
from data.sources import Blend, TokenSource

CACHE_NAME = "token_ids.json"


def _file_key(stream: np.ndarray) -> str | None:
  """``path:size:mtime`` of the file a memory-mapped stream reads, None for one in memory."""
  base = stream
  while base is not None and not isinstance(base, np.memmap):
    base = base.base if isinstance(base.base, np.ndarray) else None
  path = getattr(base, "filename", None)
  if not path:
    return None
  st = os.stat(path)
  return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{stream.dtype.str}:{len(stream)}"


def _read_cache(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _write_cache(path: str, cache: dict) -> None:
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(cache, f)
    os.replace(tmp, path)
  except OSError:  # a read-only cache only costs the scan next time
    pass


def max_token_id(source: TokenSource | Blend | SFTSource, cache_dir: str | None = None) -> int:
  """The largest token id in ``source`` (-1 when it holds none)."""
  if isinstance(source, SFTSource):
    return max((int(tokens.max()) for tokens, _ in source.examples if len(tokens)), default=-1)
  parts = source.sources if isinstance(source, Blend) else (source,)
  cache_path = os.path.join(cache_dir or corpus.default_cache_dir(), CACHE_NAME)
  cache = _read_cache(cache_path)
  largest, changed = -1, False
  for part in parts:
    for stream in part.streams:
      if not len(stream):
        continue
      key = _file_key(stream)
      if key is None or key not in cache:
        value = int(np.max(stream))
        if key is not None:
          cache[key], changed = value, True
      else:
        value = cache[key]
      largest = max(largest, value)
  if changed:
    _write_cache(cache_path, cache)
  return largest
