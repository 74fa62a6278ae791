"""data/token_ids.py: the largest token id a source really holds, cached per file."""
import json
import os

import numpy as np

import data
from data import fineweb, megatron, sft
from data.hf_tokenizer import ByteTokenizer
from data.token_ids import CACHE_NAME, max_token_id


def test_the_largest_id_of_each_format_and_of_a_blend(tmp_path):
  rng = np.random.default_rng(0)
  shards = [rng.integers(0, 1000, 5000), rng.integers(0, 60000, 3000)]
  shards[0][1234] = 4321  # above every other id of shard 0
  for i, tokens in enumerate(shards):
    fineweb.write_shard(str(tmp_path / f"fw_{i}.bin"), tokens)
  megatron.write_dataset(str(tmp_path / "mg"), [np.array([5, 9, 700], np.uint16), np.array([3], np.uint16)])
  cache = str(tmp_path / "cache")
  fw = data.load_source(str(tmp_path / "fw_*.bin"))
  assert max_token_id(fw, cache) == int(shards[1].max())  # numpy's max of the ids written
  assert max_token_id(data.load_source(str(tmp_path / "fw_0.bin")), cache) == 4321
  assert max_token_id(data.load_source(str(tmp_path / "mg")), cache) == 700
  blend = data.load_source(f"0.5:{tmp_path / 'fw_0.bin'},0.5:{tmp_path / 'mg'}")
  assert max_token_id(blend, cache) == 4321
  (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "a", "completion": "\u00ff"}) + "\n")
  source = sft.read(str(tmp_path / "sft.jsonl"), ByteTokenizer())
  assert max_token_id(source, cache) == max(int(t.max()) for t, _ in source.examples) == 256  # EOD


def test_the_scan_is_cached_per_file_and_redone_when_the_file_changes(tmp_path):
  path, cache = str(tmp_path / "fw.bin"), str(tmp_path / "cache")
  fineweb.write_shard(path, np.arange(100))
  assert max_token_id(data.load_source(path), cache) == 99
  with open(os.path.join(cache, CACHE_NAME)) as f:
    entries = json.load(f)
  assert list(entries.values()) == [99] and os.path.realpath(path) in next(iter(entries))
  # The cached value is what a later scan returns: plant another one under the same key.
  with open(os.path.join(cache, CACHE_NAME), "w") as f:
    json.dump({k: 12345 for k in entries}, f)
  assert max_token_id(data.load_source(path), cache) == 12345
  fineweb.write_shard(path, np.arange(300))  # another size: another key, scanned again
  assert max_token_id(data.load_source(path), cache) == 299
