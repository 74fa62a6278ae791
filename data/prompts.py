"""Rows of prompts (GRPO's ``--prompts``), each a dict of its columns, from

- a JSONL file: one JSON object a line;
- a Parquet file, or a folder of them (read in name order), as Hugging Face datasets
  publish them (``pyarrow``);
- a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (a folder with
  ``dataset_info.json`` or ``state.json``), or a ``DatasetDict`` saved so
  (``dataset_dict.json``): its ``train`` split, or its only one.

    rows = data.prompts.read_rows("gsm8k/train-00000-of-00001.parquet")
    rows[0]["question"], rows[0]["answer"]      # "Natalia sold clips ...", "... #### 72"

Parquet and saved datasets need the ``datasets`` extra (``pip install dion-jax[datasets]``:
``pyarrow`` and ``datasets``), imported only for them.
"""
from __future__ import annotations

import glob
import json
import os

from data.errors import DataError, DataFileNotFoundError

_EXTRA = "pip install 'dion-jax[datasets]'"


def read_rows(path: str) -> list[dict]:
  """The rows of ``path`` (module docstring); DataError when they cannot be read or there
  are none."""
  if os.path.isdir(path):
    if any(os.path.exists(os.path.join(path, n)) for n in ("dataset_dict.json", "dataset_info.json", "state.json")):
      rows = _saved_dataset(path)
    else:
      files = sorted(glob.glob(os.path.join(path, "*.parquet")))
      if not files:
        raise DataError(f"{path} is a folder with neither Parquet files nor a dataset saved by"
                        " datasets' save_to_disk; pass a JSONL or Parquet file, or such a folder")
      rows = [row for f in files for row in _parquet(f)]
  elif not os.path.isfile(path):
    raise DataFileNotFoundError(f"{path} does not exist; pass a JSONL or Parquet file of prompts, or a"
                                " folder of Parquet files or a saved dataset")
  elif path.endswith(".parquet"):
    rows = _parquet(path)
  else:
    rows = _jsonl(path)
  if not rows:
    raise DataError(f"{path} holds no prompts")
  return rows


def _jsonl(path: str) -> list[dict]:
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number}: not JSON ({e.msg})") from None
      if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: a line must be a JSON object of columns")
      rows.append(row)
  return rows


def _parquet(path: str) -> list[dict]:
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError(f"{path}: reading Parquet needs pyarrow; {_EXTRA}") from None
  try:
    return pq.read_table(path).to_pylist()
  except Exception as e:  # noqa: BLE001  pyarrow's errors for a bad file are of several kinds
    raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _saved_dataset(path: str) -> list[dict]:
  try:
    import datasets
  except ImportError:
    raise DataError(f"{path}: reading a saved dataset needs datasets; {_EXTRA}") from None
  try:
    dataset = datasets.load_from_disk(path)
  except Exception as e:  # noqa: BLE001  datasets raises several kinds for a damaged folder
    raise DataError(f"{path}: not a readable saved dataset ({type(e).__name__}: {e})") from None
  if isinstance(dataset, datasets.DatasetDict):
    if "train" not in dataset and len(dataset) != 1:
      raise DataError(f"{path} holds the splits {', '.join(dataset)} and none is train; pass the"
                      f" folder of one split ({os.path.join(path, next(iter(dataset)))})")
    dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
  return dataset.to_list()
