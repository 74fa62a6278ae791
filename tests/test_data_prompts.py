"""data.prompts: the rows of GRPO's prompts from JSONL, Parquet files and folders, and
datasets saved with ``save_to_disk``; bad paths and files are one-line DataErrors."""
import json

import pytest

from data import DataError
from data import prompts

ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "What is 10 - 4?", "answer": "10 - 4 = 6\n#### 6"},
        {"question": "What is 1,000 + 1?", "answer": "1,000 + 1 = 1,001\n#### 1,001"}]


def test_jsonl(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
  assert prompts.read_rows(str(path)) == ROWS
  path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
  with pytest.raises(DataError, match="rows.jsonl:2: a line must be a JSON object"):
    prompts.read_rows(str(path))


def test_parquet_file_and_folder(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  pq.write_table(pa.Table.from_pylist(ROWS[:2]), str(tmp_path / "train-00000.parquet"))
  pq.write_table(pa.Table.from_pylist(ROWS[2:]), str(tmp_path / "train-00001.parquet"))
  assert prompts.read_rows(str(tmp_path / "train-00001.parquet")) == ROWS[2:]
  assert prompts.read_rows(str(tmp_path)) == ROWS  # the folder's files in name order
  (tmp_path / "broken.parquet").write_bytes(b"not parquet")
  with pytest.raises(DataError, match="broken.parquet: not a readable Parquet file"):
    prompts.read_rows(str(tmp_path / "broken.parquet"))


def test_saved_datasets(tmp_path):
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
  assert prompts.read_rows(str(tmp_path / "one")) == ROWS
  datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                        "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(tmp_path / "splits"))
  assert prompts.read_rows(str(tmp_path / "splits")) == ROWS[:2]  # the train split
  datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS), "b": datasets.Dataset.from_list(ROWS)}
                       ).save_to_disk(str(tmp_path / "other"))
  with pytest.raises(DataError, match="holds the splits a, b and none is train"):
    prompts.read_rows(str(tmp_path / "other"))


def test_missing_and_empty(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing.jsonl does not exist"):
    prompts.read_rows(str(tmp_path / "nothing.jsonl"))
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(DataError, match="holds no prompts"):
    prompts.read_rows(str(tmp_path / "empty.jsonl"))
  (tmp_path / "folder").mkdir()
  with pytest.raises(DataError, match="neither Parquet files nor a dataset saved"):
    prompts.read_rows(str(tmp_path / "folder"))
