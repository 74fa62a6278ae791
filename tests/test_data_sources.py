import numpy as np
import pytest

from data import fineweb, megatron, sources, tokenizer
from data.errors import DataError, DataFileNotFoundError


def test_fineweb_glob_gives_one_stream_per_shard_in_name_order(tmp_path):
  fineweb.write_shard(str(tmp_path / "fw_000001.bin"), [4, 5])
  fineweb.write_shard(str(tmp_path / "fw_000000.bin"), [1, 2, 3])
  src = sources.load_source(str(tmp_path / "fw_*.bin"))
  assert [s.tolist() for s in src.streams] == [[1, 2, 3], [4, 5]]
  assert src.vocab_size == 50257 and src.num_tokens == 5
  single = sources.load_source(str(tmp_path / "fw_000001.bin"))
  assert [s.tolist() for s in single.streams] == [[4, 5]]


@pytest.mark.parametrize("suffix", ["", ".idx", ".bin"])
def test_megatron_prefix_with_or_without_extension(tmp_path, suffix):
  megatron.write_dataset(str(tmp_path / "m"), [[1, 2], [3]], np.uint16)
  src = sources.load_source(str(tmp_path / "m") + suffix)
  assert [s.tolist() for s in src.streams] == [[1, 2, 3]]
  assert src.vocab_size is None


def test_stdlib_splits(tmp_path):
  train = sources.load_source("stdlib", cache_dir=str(tmp_path), progress=False)
  val = sources.load_source("stdlib:val", cache_dir=str(tmp_path), progress=False)
  assert train.vocab_size == tokenizer.VOCAB_SIZE
  assert train.num_tokens > 50 * val.num_tokens > 0
  assert int(train.streams[0][-1]) == tokenizer.EOD
  assert sources.load_source("stdlib:train", cache_dir=str(tmp_path)).num_tokens == \
      train.num_tokens
  with pytest.raises(DataError, match="^stdlib:test: unknown split 'test'; use stdlib:train or stdlib:val$"):
    sources.load_source("stdlib:test", cache_dir=str(tmp_path))


def test_blend_normalizes_weights_and_keeps_order(tmp_path):
  megatron.write_dataset(str(tmp_path / "a"), [[1, 2]], np.uint16)
  fineweb.write_shard(str(tmp_path / "b.bin"), [3])
  blend = sources.load_source(f"3:{tmp_path}/a, 1:{tmp_path}/b.bin")
  assert isinstance(blend, sources.Blend)
  assert blend.weights == (0.75, 0.25)
  assert [s.name for s in blend.sources] == [f"{tmp_path}/a", f"{tmp_path}/b.bin"]
  assert blend.vocab_size is None
  assert blend.name == f"0.75:{tmp_path}/a,0.25:{tmp_path}/b.bin"


def test_blend_of_one_weighted_spec(tmp_path):
  fineweb.write_shard(str(tmp_path / "b.bin"), [3])
  blend = sources.load_source(f"0.5:{tmp_path}/b.bin")
  assert blend.weights == (1.0,) and blend.vocab_size == 50257


@pytest.mark.parametrize("spec,error,message", [
    ("a,b", DataError, "a,b: every part of a blend needs a weight"),
    ("1:a,-1:b", DataError, "1:a,-1:b: blend weights must be positive"),
    ("", DataError, "empty data source spec"),
])
def test_bad_specs(spec, error, message):
  with pytest.raises(error) as e:
    sources.load_source(spec)
  assert str(e.value).startswith(message)


def test_missing_paths_name_the_spec(tmp_path):
  with pytest.raises(DataFileNotFoundError) as e:
    sources.load_source(str(tmp_path / "missing"))
  assert str(e.value) == (f"{tmp_path}/missing: no such FineWeb shard, shard glob or "
                          "Megatron prefix (PREFIX.idx)")
  with pytest.raises(DataFileNotFoundError, match="no FineWeb shards match"):
    sources.load_source(str(tmp_path / "fw_*.bin"))


def test_text_given_as_token_data_names_the_conversion(tmp_path):
  """A text or JSONL file where token data goes: was 'truncated FineWeb header' alone."""
  (tmp_path / "notes.txt").write_text("hello")
  for spec, error in ((tmp_path / "notes.txt", "truncated FineWeb header (5 bytes, need 1024)"),
                      (tmp_path / "absent.jsonl", "no such FineWeb shard, shard glob or Megatron prefix (PREFIX.idx)")):
    with pytest.raises(DataError) as e:
      sources.load_source(str(spec))
    assert str(e.value) == (f"{spec}: {error}; text or JSONL is tokenized first (python -m data.convert tokenize"
                            " FILE --output-prefix PREFIX, then the spec PREFIX), and fine-tuning examples are"
                            " sft:FILE.jsonl")


def test_a_megatron_bin_without_index_is_not_a_fineweb_shard(tmp_path):
  (tmp_path / "x.bin").write_bytes(b"\x01\x00" * 600)
  with pytest.raises(DataError, match=r"x\.bin: wrong magic 65537"):
    sources.load_source(str(tmp_path / "x.bin"))
