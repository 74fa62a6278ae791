"""Megatron indexed datasets, checked against the MMIDIDX layout of Megatron-Core's
megatron/core/datasets/indexed_dataset.py, spelled out here with struct."""
import struct

import numpy as np
import pytest

from data import megatron
from data.errors import DataError, DataFileNotFoundError

# Megatron-Core's DType enum.
CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6,
         "float32": 7, "uint16": 8}


def _expected_idx(code, lengths, itemsize, doc_indices):
  out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
  out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
  out += struct.pack(f"<{len(lengths)}i", *lengths)
  pointers, offset = [], 0
  for n in lengths:
    pointers.append(offset)
    offset += n * itemsize
  out += struct.pack(f"<{len(lengths)}q", *pointers)
  out += struct.pack(f"<{len(doc_indices)}q", *doc_indices)
  return out


def test_writer_is_byte_identical_to_the_format_definition(tmp_path):
  prefix = str(tmp_path / "ds")
  megatron.write_dataset(prefix, [[1, 2, 3], [65535], [], [7, 8]], np.uint16)
  idx = open(prefix + ".idx", "rb").read()
  assert idx == _expected_idx(8, [3, 1, 0, 2], 2, [0, 1, 2, 3, 4])
  assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 1, 2, 3, 65535, 7, 8)
  # Field by field, at the offsets Megatron-Core reads them from.
  assert idx[:9] == b"MMIDIDX\x00\x00"
  assert struct.unpack_from("<QBQQ", idx, 9) == (1, 8, 4, 5)
  assert struct.unpack_from("<4i", idx, 34) == (3, 1, 0, 2)
  assert struct.unpack_from("<4q", idx, 34 + 16) == (0, 6, 8, 8)
  assert struct.unpack_from("<5q", idx, 34 + 16 + 32) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64", "uint16",
                                   "float32", "float64"])
def test_round_trip_every_megatron_dtype(tmp_path, dtype):
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 1, 17)]
  prefix = str(tmp_path / dtype)
  megatron.write_dataset(prefix, docs, dtype)
  assert open(prefix + ".idx", "rb").read() == _expected_idx(
      CODES[dtype], [5, 1, 17], np.dtype(dtype).itemsize, [0, 1, 2, 3])
  ds = megatron.IndexedDataset(prefix)
  assert ds.dtype == np.dtype(dtype) and len(ds) == 3 and ds.num_documents == 3
  for i, doc in enumerate(docs):
    np.testing.assert_array_equal(ds[i], doc)
  np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))


def test_reads_a_handmade_dataset_with_several_sequences_per_document(tmp_path):
  # Two documents: sequences {0, 1} and {2}; int32 tokens.
  prefix = tmp_path / "hand"
  (tmp_path / "hand.idx").write_bytes(_expected_idx(4, [2, 3, 1], 4, [0, 2, 3]))
  (tmp_path / "hand.bin").write_bytes(struct.pack("<6i", 10, 11, 20, 21, 22, 30))
  ds = megatron.IndexedDataset(str(prefix))
  assert ds.num_documents == 2
  np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])
  np.testing.assert_array_equal(ds[1], [20, 21, 22])
  np.testing.assert_array_equal(ds.sequence_pointers, [0, 8, 20])


def test_reads_megatron_dion_converter_output(tmp_path):
  # tools/convert_dion_to_megatron.py writes document indices [1, ..., S] (no leading 0).
  (tmp_path / "d.idx").write_bytes(_expected_idx(8, [3, 3], 2, [1, 2]))
  (tmp_path / "d.bin").write_bytes(struct.pack("<6H", *range(6)))
  ds = megatron.IndexedDataset(str(tmp_path / "d"))
  np.testing.assert_array_equal(ds[1], [3, 4, 5])


def test_writer_rejects_tokens_that_do_not_fit(tmp_path):
  with pytest.raises(DataError, match=r"token ids \[0, 300\] do not fit uint8"):
    megatron.write_dataset(str(tmp_path / "x"), [[0, 300]], np.uint8)


def test_multi_sequence_add_document(tmp_path):
  prefix = str(tmp_path / "m")
  with megatron.IndexedDatasetWriter(prefix, np.uint16) as w:
    w.add_document(np.arange(10), [4, 6])
    assert w.num_documents == 2
  assert open(prefix + ".idx", "rb").read() == _expected_idx(8, [4, 6], 2, [0, 1, 2])


def _write(tmp_path, idx_bytes, bin_bytes=b""):
  (tmp_path / "bad.idx").write_bytes(idx_bytes)
  (tmp_path / "bad.bin").write_bytes(bin_bytes)
  return str(tmp_path / "bad")


GOOD = _expected_idx(8, [2, 1], 2, [0, 1, 2])
GOOD_BIN = struct.pack("<3H", 1, 2, 3)


@pytest.mark.parametrize("idx,bin_,message", [
    (b"MMIDIDX\x00\x00\x01", GOOD_BIN, "bad.idx: truncated index header (10 bytes, need 34)"),
    (b"MMIDIDY\x00\x00" + GOOD[9:], GOOD_BIN, "bad.idx: wrong magic b'MMIDIDY\\x00\\x00'"),
    (GOOD[:9] + struct.pack("<Q", 2) + GOOD[17:], GOOD_BIN,
     "bad.idx: unsupported index version 2"),
    (GOOD[:17] + b"\x09" + GOOD[18:], GOOD_BIN, "bad.idx: unknown dtype code 9"),
    (GOOD[:-1], GOOD_BIN, "bad.idx: truncated index (81 bytes; 2 sequences and 3 document "
     "indices need 82)"),
    (GOOD + b"\x00" * 5, GOOD_BIN, "bad.idx: 5 unexpected trailing bytes"),
    (_expected_idx(8, [2, 1], 2, [0, 1]), GOOD_BIN, "bad.idx: document indices must rise"),
    (GOOD, GOOD_BIN[:-2], "bad.bin: 4 bytes but the index describes 3 tokens of uint16"),
])
def test_bad_datasets_name_the_file_and_problem(tmp_path, idx, bin_, message):
  prefix = _write(tmp_path, idx, bin_)
  with pytest.raises(DataError) as e:
    megatron.IndexedDataset(prefix)
  assert str(e.value).startswith(f"{tmp_path}/{message}")
  assert "\n" not in str(e.value)


def test_non_contiguous_pointers_are_rejected(tmp_path):
  idx = bytearray(GOOD)
  struct.pack_into("<q", idx, 34 + 8 + 8, 6)  # second pointer 6 instead of 4
  with pytest.raises(DataError, match="pointers are not the running sum"):
    megatron.IndexedDataset(_write(tmp_path, bytes(idx), GOOD_BIN))


def test_missing_files(tmp_path):
  with pytest.raises(DataFileNotFoundError, match=r"nope\.idx: no such Megatron index"):
    megatron.IndexedDataset(str(tmp_path / "nope"))
  (tmp_path / "only.idx").write_bytes(GOOD)
  with pytest.raises(DataFileNotFoundError, match=r"only\.bin: no such Megatron token file"):
    megatron.IndexedDataset(str(tmp_path / "only"))


def test_dtype_for_vocab_follows_megatron():
  assert megatron.dtype_for_vocab(257) == np.uint16
  assert megatron.dtype_for_vocab(65499) == np.uint16
  assert megatron.dtype_for_vocab(65500) == np.int32
