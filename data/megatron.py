"""Megatron-Core indexed datasets: `PREFIX.bin` (tokens) + `PREFIX.idx` (the MMIDIDX index).

Byte-compatible with `megatron/core/datasets/indexed_dataset.py`. The `.idx` layout,
all little-endian:

    b"MMIDIDX\\x00\\x00"            9-byte magic
    uint64  version = 1
    uint8   dtype code              (DTYPE_CODES below)
    uint64  S = sequence count
    uint64  D = document count      (length of the document index array)
    int32   sequence_lengths[S]     tokens per sequence
    int64   sequence_pointers[S]    byte offset of each sequence in the .bin
    int64   document_indices[D]     sequence index at each document boundary: [0, ..., S]
   (int8    sequence_modes[S]       multimodal datasets only; not written, ignored on read)

The `.bin` holds the sequences back to back in the index's dtype. Our writer makes every
document one sequence, as `tools/preprocess_data.py` does without sentence splitting.
"""
import os
import struct

import numpy as np

from data.errors import DataError, DataFileNotFoundError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def idx_path(prefix: str) -> str:
  return prefix + ".idx"


def bin_path(prefix: str) -> str:
  return prefix + ".bin"


def exists(prefix: str) -> bool:
  return os.path.isfile(idx_path(prefix))


def dtype_for_vocab(vocab_size: int) -> np.dtype:
  """The token dtype Megatron picks for a vocabulary (`DType.optimal_dtype`)."""
  return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDataset:
  """Read-only view of a Megatron indexed dataset; everything is memory-mapped.

  Attributes:
    dtype: token dtype from the index's dtype code.
    sequence_lengths: int32 [S]; sequence_pointers: int64 [S] byte offsets;
    document_indices: int64 [D].
    tokens: all tokens of the `.bin`, in order, a memmap [sum(sequence_lengths)].
  """

  def __init__(self, prefix: str):
    self.prefix = prefix
    path = idx_path(prefix)
    if not os.path.isfile(path):
      raise DataFileNotFoundError(f"{path}: no such Megatron index")
    index = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else b""
    if len(index) < HEADER.size:
      raise DataError(f"{path}: truncated index header ({len(index)} bytes, need {HEADER.size})")
    magic, version, code, S, D = HEADER.unpack(bytes(index[:HEADER.size]))
    if magic != MAGIC:
      raise DataError(f"{path}: wrong magic {magic!r} (a Megatron index starts with {MAGIC!r})")
    if version != VERSION:
      raise DataError(f"{path}: unsupported index version {version} (expected {VERSION})")
    if code not in DTYPE_CODES:
      raise DataError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    self.dtype = np.dtype(DTYPE_CODES[code])
    expected = HEADER.size + 12 * S + 8 * D
    if len(index) < expected:
      raise DataError(f"{path}: truncated index ({len(index)} bytes; {S} sequences and "
                      f"{D} document indices need {expected})")
    if len(index) not in (expected, expected + S):
      raise DataError(f"{path}: {len(index) - expected} unexpected trailing bytes")
    buf, offset = memoryview(index), HEADER.size
    self.sequence_lengths = np.frombuffer(buf, "<i4", S, offset)
    self.sequence_pointers = np.frombuffer(buf, "<i8", S, offset + 4 * S)
    self.document_indices = np.frombuffer(buf, "<i8", D, offset + 12 * S)
    self._check_index(path)
    self.tokens = self._map_tokens()

  def _check_index(self, path: str):
    S = len(self.sequence_lengths)
    docs = self.document_indices
    if len(docs) == 0 or docs[-1] != S or np.any(np.diff(docs) < 0) or docs[0] < 0:
      raise DataError(f"{path}: document indices must rise to the sequence count {S}")
    if np.any(self.sequence_lengths < 0):
      raise DataError(f"{path}: negative sequence length")
    starts = np.zeros(S, np.int64)
    np.cumsum(self.sequence_lengths[:-1] * np.int64(self.dtype.itemsize), out=starts[1:])
    if not np.array_equal(starts, self.sequence_pointers):
      raise DataError(f"{path}: sequence pointers are not the running sum of the lengths")

  def _map_tokens(self) -> np.ndarray:
    path = bin_path(self.prefix)
    if not os.path.isfile(path):
      raise DataFileNotFoundError(f"{path}: no such Megatron token file")
    count = int(self.sequence_lengths.sum(dtype=np.int64))
    size = os.path.getsize(path)
    if size != count * self.dtype.itemsize:
      raise DataError(f"{path}: {size} bytes but the index describes {count} tokens of "
                      f"{self.dtype.name} ({count * self.dtype.itemsize} bytes)")
    if count == 0:
      return np.zeros((0,), self.dtype)
    return np.memmap(path, dtype=self.dtype.newbyteorder("<"), mode="r", shape=(count,))

  def __len__(self) -> int:
    return len(self.sequence_lengths)

  def __getitem__(self, i: int) -> np.ndarray:
    """Tokens of sequence `i`."""
    start = self.sequence_pointers[i] // self.dtype.itemsize
    return self.tokens[start:start + self.sequence_lengths[i]]

  @property
  def num_documents(self) -> int:
    return len(self.document_indices) - 1


class IndexedDatasetWriter:
  """Streams documents into `PREFIX.bin`, then writes `PREFIX.idx` when the block exits.

  `with IndexedDatasetWriter(prefix, np.uint16) as w: w.add_document(tokens)`; each
  document is one sequence. The `.idx` is only written when the block exits without an
  exception; the caller owns atomicity (see `data.convert`).
  """

  def __init__(self, prefix: str, dtype=np.uint16):
    self.dtype = np.dtype(dtype)
    if self.dtype not in CODE_OF_DTYPE:
      raise DataError(f"{prefix}: dtype {self.dtype} has no Megatron dtype code")
    self.prefix = prefix
    self._lengths: list[np.ndarray] = []
    self._bin = open(bin_path(prefix), "wb")

  def add_document(self, tokens, lengths=None) -> None:
    """Appends `tokens` as one document, or as several back to back of `lengths` tokens."""
    tokens = np.asarray(tokens)
    lengths = np.asarray([tokens.size] if lengths is None else lengths, dtype=np.int64)
    if tokens.ndim != 1 or lengths.sum() != tokens.size:
      raise DataError(f"{self.prefix}: documents must be 1-D and match their lengths")
    if self.dtype.kind in "iu" and tokens.size:
      info = np.iinfo(self.dtype)
      if tokens.min() < info.min or tokens.max() > info.max:
        raise DataError(f"{self.prefix}: token ids [{tokens.min()}, {tokens.max()}] do not "
                        f"fit {self.dtype.name}")
    if lengths.size and lengths.max() >= 2**31:
      raise DataError(f"{self.prefix}: a sequence of {lengths.max()} tokens overflows int32")
    self._bin.write(tokens.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
    self._lengths.append(lengths.astype(np.int32))

  @property
  def num_documents(self) -> int:
    return sum(len(x) for x in self._lengths)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc):
    self._bin.close()
    if exc_type is None:
      lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
      write_index(idx_path(self.prefix), self.dtype, lengths)


def write_index(path: str, dtype, sequence_lengths, document_indices=None) -> None:
  """Writes a `.idx` for sequences of `sequence_lengths` stored back to back.

  `document_indices` defaults to one document per sequence, `[0, 1, ..., S]`.
  """
  dtype = np.dtype(dtype)
  lengths = np.asarray(sequence_lengths, dtype="<i4")
  S = len(lengths)
  pointers = np.zeros(S, "<i8")
  np.cumsum(lengths[:-1] * np.int64(dtype.itemsize), out=pointers[1:])
  docs = np.arange(S + 1, dtype="<i8") if document_indices is None else np.asarray(
      document_indices, "<i8")
  with open(path, "wb") as f:
    f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], S, len(docs)))
    f.write(lengths.tobytes())
    f.write(pointers.tobytes())
    f.write(docs.tobytes())


def write_dataset(prefix: str, documents, dtype=np.uint16) -> None:
  """Writes `documents` (1-D token arrays) as the dataset `prefix`."""
  with IndexedDatasetWriter(prefix, dtype) as writer:
    for doc in documents:
      writer.add_document(doc)
