"""FineWeb token shards in the reference's `.bin` format (microsoft/dion, modded-nanogpt).

Layout: a header of 256 little-endian int32 — magic 20240520, version 1, token count,
then zeros — followed by the tokens as uint16 (GPT-2 ids for FineWeb; our converter also
writes byte-tokenizer ids). Shards are read by memory map, so opening one costs nothing.
"""
import glob
import os

import numpy as np

from data.errors import DataError, DataFileNotFoundError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
GPT2_VOCAB_SIZE = 50257


def read_header(path: str) -> int:
  """Validates the header and size of shard `path`; returns its token count."""
  if not os.path.isfile(path):
    raise DataFileNotFoundError(f"{path}: no such FineWeb shard")
  size = os.path.getsize(path)
  if size < HEADER_BYTES:
    raise DataError(f"{path}: truncated FineWeb header ({size} bytes, need {HEADER_BYTES})")
  header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
  magic, version, count = (int(x) for x in header[:3])
  if magic != MAGIC:
    raise DataError(f"{path}: wrong magic {magic} (a FineWeb shard starts with {MAGIC})")
  if version != VERSION:
    raise DataError(f"{path}: unsupported FineWeb version {version} (expected {VERSION})")
  expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * count
  if count < 0 or size != expected:
    raise DataError(
        f"{path}: header says {count} tokens ({expected} bytes) but the file has {size} bytes")
  return count


def read_shard(path: str) -> np.ndarray:
  """The tokens of shard `path`, a read-only uint16 memmap [count]."""
  count = read_header(path)
  if count == 0:
    return np.zeros((0,), TOKEN_DTYPE)
  return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def shard_paths(pattern: str) -> list[str]:
  """Sorted shard paths matching glob `pattern`; an error if there are none."""
  paths = sorted(glob.glob(pattern))
  if not paths:
    raise DataFileNotFoundError(f"{pattern}: no FineWeb shards match")
  return paths


def write_shard(path: str, tokens) -> int:
  """Writes `tokens` (ints in [0, 65535]) to `path` in the `.bin` format; returns bytes.

  The caller owns atomicity (`data.convert` writes into a temporary directory first).
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise DataError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
  if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
    raise DataError(f"{path}: token ids must fit in uint16, got [{tokens.min()}, {tokens.max()}]")
  if tokens.size >= 2**31:
    raise DataError(f"{path}: {tokens.size} tokens do not fit an int32 header count")
  header = np.zeros(HEADER_INTS, dtype="<i4")
  header[:3] = (MAGIC, VERSION, tokens.size)
  with open(path, "wb") as f:
    f.write(header.tobytes())
    f.write(tokens.astype(TOKEN_DTYPE).tobytes())
  return HEADER_BYTES + TOKEN_DTYPE.itemsize * tokens.size
