import os
import zlib

import numpy as np
import pytest

from data import corpus, megatron, tokenizer
from data.errors import DataError, DataFileNotFoundError

FILES = {
    "a.py": b"import os\n",
    "pkg/__init__.py": b"",
    "pkg/mod.py": "x = 'é'\n".encode(),
    "pkg/zeta.py": b"pass\n",
    "b.py": b"def f():\n  return 1\n",
    "notes.txt": b"not python",
    "site-packages/third_party.py": b"installed, not stdlib",
    "pkg/__pycache__/mod.py": b"cache",
}


@pytest.fixture
def fake_stdlib(tmp_path):
  root = tmp_path / "lib"
  for rel, data in FILES.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
  return str(root)


def test_source_files_are_sorted_python_files_without_installed_packages(fake_stdlib):
  assert corpus.source_files(fake_stdlib) == [
      "a.py", "b.py", "pkg/__init__.py", "pkg/mod.py", "pkg/zeta.py"]


def test_split_is_a_stable_hash_of_the_relative_path():
  # Independent of the other files: the CRC32 of the path against the fraction.
  for rel in ("a.py", "email/utils.py", "json/decoder.py"):
    expected = "val" if zlib.crc32(rel.encode()) / 2**32 < 0.3 else "train"
    assert corpus.split_of(rel, 0.3) == expected
  assert corpus.split_of("anything.py", 0.0) == "train"
  assert corpus.split_of("anything.py", 1.0) == "val"


def test_build_tokenizes_each_file_as_one_document(fake_stdlib, tmp_path):
  prefixes = corpus.build_corpus(fake_stdlib, str(tmp_path / "cache"), val_fraction=0.4,
                                 progress=False)
  files = corpus.source_files(fake_stdlib)
  splits = corpus.assign_splits(files, 0.4)
  assert sorted(splits["train"] + splits["val"]) == files
  for split, prefix in prefixes.items():
    assert prefix.startswith(str(tmp_path / "cache"))
    ds = megatron.IndexedDataset(prefix)
    expected = [np.frombuffer(FILES[f], np.uint8).tolist() + [tokenizer.EOD]
                for f in splits[split]]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.dtype == np.uint16


def test_both_splits_get_a_file_even_when_the_hash_gives_none(fake_stdlib):
  splits = corpus.assign_splits(corpus.source_files(fake_stdlib), 0.0)
  lowest = min(corpus.source_files(fake_stdlib), key=lambda f: zlib.crc32(f.encode()))
  assert splits["val"] == [lowest] and len(splits["train"]) == 4


def test_cache_is_reused_and_follows_the_environment(fake_stdlib, tmp_path, monkeypatch):
  monkeypatch.setenv("DION_JAX_CACHE", str(tmp_path / "envcache"))
  first = corpus.build_corpus(fake_stdlib, progress=False)
  assert first["train"].startswith(str(tmp_path / "envcache") + os.sep)
  stamp = os.stat(first["train"] + ".bin").st_mtime_ns
  monkeypatch.setattr(corpus.tokenizer, "encode", lambda *a, **k: 1 / 0)  # must not rebuild
  assert corpus.build_corpus(fake_stdlib, progress=False) == first
  assert os.stat(first["train"] + ".bin").st_mtime_ns == stamp


def test_changed_files_get_a_new_cache_entry(fake_stdlib, tmp_path):
  cache = str(tmp_path / "c")
  first = corpus.build_corpus(fake_stdlib, cache, progress=False)
  with open(os.path.join(fake_stdlib, "b.py"), "ab") as f:
    f.write(b"# more\n")
  assert corpus.build_corpus(fake_stdlib, cache, progress=False) != first


def test_failed_build_leaves_nothing_in_the_cache(fake_stdlib, tmp_path, monkeypatch):
  cache = tmp_path / "c"
  monkeypatch.setattr(corpus.tokenizer, "encode", lambda *a, **k: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    corpus.build_corpus(fake_stdlib, str(cache), progress=False)
  assert os.listdir(cache) == []


def test_empty_or_missing_corpus(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "readme.txt").write_text("no python here")
  with pytest.raises(DataError, match=r"empty: no \*\.py files, the corpus would be empty"):
    corpus.build_corpus(str(tmp_path / "empty"), str(tmp_path / "c"), progress=False)
  with pytest.raises(DataFileNotFoundError, match=r"nope: no such corpus directory"):
    corpus.build_corpus(str(tmp_path / "nope"), str(tmp_path / "c"), progress=False)
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "x.py").write_text("x = 1\n")
  with pytest.raises(DataError, match="at least 2"):
    corpus.build_corpus(str(tmp_path / "one"), str(tmp_path / "c"), progress=False)


def test_real_stdlib_builds_and_splits_about_one_percent(tmp_path):
  prefixes = corpus.build_corpus(cache_dir=str(tmp_path), progress=False)
  train, val = (megatron.IndexedDataset(prefixes[s]) for s in ("train", "val"))
  files = corpus.source_files(corpus.stdlib_dir())
  assert len(train) + len(val) == len(files) > 500
  assert 0.002 < len(val) / len(files) < 0.03
  assert "os.py" in files and not any("site-packages" in f for f in files)
  i = corpus.assign_splits(files, 0.01)["train"].index("os.py")
  with open(os.path.join(corpus.stdlib_dir(), "os.py"), "rb") as f:
    assert tokenizer.decode(train[i][:-1]) == f.read().decode("utf-8")
