import struct

import numpy as np
import pytest

from data import fineweb
from data.errors import DataError, DataFileNotFoundError


def _handmade_shard(path, tokens, magic=20240520, version=1, count=None):
  header = struct.pack("<3i", magic, version, len(tokens) if count is None else count)
  path.write_bytes(header + bytes(1024 - 12) + struct.pack(f"<{len(tokens)}H", *tokens))
  return str(path)


def test_writer_produces_the_reference_layout(tmp_path):
  path = str(tmp_path / "s.bin")
  assert fineweb.write_shard(path, [5, 65535, 0]) == 1024 + 6
  expected = _handmade_shard(tmp_path / "ref.bin", [5, 65535, 0])
  assert open(path, "rb").read() == open(expected, "rb").read()


def test_round_trip_by_memmap(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 50257, size=1000)
  path = str(tmp_path / "s.bin")
  fineweb.write_shard(path, tokens)
  read = fineweb.read_shard(path)
  assert isinstance(read, np.memmap) and read.dtype == np.uint16
  np.testing.assert_array_equal(read, tokens)


def test_empty_shard_reads_as_no_tokens(tmp_path):
  path = _handmade_shard(tmp_path / "e.bin", [])
  assert fineweb.read_shard(path).shape == (0,)


def test_shard_paths_are_sorted(tmp_path):
  for name in ("t_000002.bin", "t_000000.bin", "t_000001.bin", "v_000000.bin"):
    fineweb.write_shard(str(tmp_path / name), [1])
  names = [p.rsplit("/", 1)[1] for p in fineweb.shard_paths(str(tmp_path / "t_*.bin"))]
  assert names == ["t_000000.bin", "t_000001.bin", "t_000002.bin"]


@pytest.mark.parametrize("kwargs,tokens,message", [
    (dict(magic=20240521), [1, 2], "wrong magic 20240521"),
    (dict(version=2), [1, 2], "unsupported FineWeb version 2"),
    (dict(count=3), [1, 2], "header says 3 tokens (1030 bytes) but the file has 1028 bytes"),
    (dict(count=1), [1, 2], "header says 1 tokens (1026 bytes) but the file has 1028 bytes"),
])
def test_bad_shards_name_the_file_and_problem(tmp_path, kwargs, tokens, message):
  path = _handmade_shard(tmp_path / "bad.bin", tokens, **kwargs)
  with pytest.raises(DataError) as e:
    fineweb.read_shard(path)
  assert str(e.value).startswith(f"{path}: {message}")
  assert "\n" not in str(e.value)


def test_truncated_header_and_missing_paths(tmp_path):
  short = tmp_path / "short.bin"
  short.write_bytes(b"\x00" * 100)
  with pytest.raises(DataError, match=r"short\.bin: truncated FineWeb header \(100 bytes"):
    fineweb.read_shard(str(short))
  with pytest.raises(DataFileNotFoundError, match=r"nope\.bin: no such FineWeb shard"):
    fineweb.read_shard(str(tmp_path / "nope.bin"))
  with pytest.raises(FileNotFoundError, match=r"x_\*\.bin: no FineWeb shards match"):
    fineweb.shard_paths(str(tmp_path / "x_*.bin"))


def test_writer_rejects_ids_outside_uint16(tmp_path):
  with pytest.raises(DataError, match="fit in uint16"):
    fineweb.write_shard(str(tmp_path / "s.bin"), [1, 70000])
