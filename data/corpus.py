"""The embedded default corpus: the Python standard library's own source files.

Every machine with Python has it, so training and tests need no download. The `*.py`
files under `sysconfig.get_paths()["stdlib"]` (installed packages excluded), in sorted
order, are byte-tokenized one document each, every document ended by `tokenizer.EOD`.
A file goes to validation when a stable hash of its relative path falls below
`val_fraction`, so the split is deterministic and a file never straddles it.

The token files are Megatron indexed datasets (`train`, `val`) cached under
`$DION_JAX_CACHE` or `~/.cache/dion_jax`, in a folder keyed by the Python version and a
fingerprint of the file list, built once (a couple of seconds) and atomically renamed
into place, so concurrent builders and interrupted builds are harmless.
"""
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import zlib

from data import megatron, tokenizer
from data.errors import DataError, DataFileNotFoundError
from data.progress import Progress

SPLITS = ("train", "val")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_FORMAT = 1  # bump when the tokenization or layout changes


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def default_cache_dir() -> str:
  return os.environ.get("DION_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "dion_jax")


def source_files(root: str) -> list[str]:
  """Sorted relative paths of the `*.py` files under `root`, installed packages excluded."""
  if not os.path.isdir(root):
    raise DataFileNotFoundError(f"{root}: no such corpus directory")
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    rel = os.path.relpath(dirpath, root)
    found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
  return sorted(p.replace(os.sep, "/") for p in found)


def split_of(relpath: str, val_fraction: float) -> str:
  """"val" if the CRC32 of `relpath` falls in the lowest `val_fraction` of its range."""
  return "val" if zlib.crc32(relpath.encode()) < val_fraction * 2**32 else "train"


def assign_splits(files: list[str], val_fraction: float, root: str = "") -> dict[str, list[str]]:
  """Train/validation file lists; each gets at least one file (the lowest hash goes to val)."""
  if len(files) < 2:
    raise DataError(f"{root}: the corpus needs at least 2 *.py files for a train/validation "
                    f"split, found {len(files)}")
  splits = {s: [f for f in files if split_of(f, val_fraction) == s] for s in SPLITS}
  if not splits["val"] or not splits["train"]:
    by_hash = sorted(files, key=lambda f: zlib.crc32(f.encode()))
    splits = {"val": sorted(by_hash[:1]), "train": sorted(by_hash[1:])}
  return splits


def _fingerprint(root: str, files: list[str], val_fraction: float) -> str:
  h = hashlib.sha256(f"{_FORMAT}|{os.path.abspath(root)}|{val_fraction!r}".encode())
  for f in files:
    st = os.stat(os.path.join(root, f))
    h.update(f"|{f}:{st.st_size}:{st.st_mtime_ns}".encode())
  return h.hexdigest()[:16]


def build_corpus(root: str | None = None, cache_dir: str | None = None, *,
                 val_fraction: float = 0.01, progress: bool = True) -> dict[str, str]:
  """Builds (or finds in the cache) the corpus of `root`; returns {split: dataset prefix}.

  Args:
    root: directory of source files; defaults to the running interpreter's stdlib.
    cache_dir: where token files live; defaults to `default_cache_dir()`.
    val_fraction: expected fraction of files in the validation split.
    progress: draw a progress bar on stderr while building.
  """
  root = stdlib_dir() if root is None else root
  cache_dir = default_cache_dir() if cache_dir is None else cache_dir
  files = source_files(root)
  if not files:
    raise DataError(f"{root}: no *.py files, the corpus would be empty")
  splits = assign_splits(files, val_fraction, root)
  version = f"py{sys.version_info.major}.{sys.version_info.minor}"
  final = os.path.join(cache_dir, f"stdlib-{version}-{_fingerprint(root, files, val_fraction)}")
  prefixes = {s: os.path.join(final, s) for s in SPLITS}
  if all(megatron.exists(p) for p in prefixes.values()):
    return prefixes
  os.makedirs(cache_dir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".building-", dir=cache_dir)
  try:
    with Progress(f"building corpus {final}", len(files), "files", enabled=progress) as bar:
      for split in SPLITS:
        with megatron.IndexedDatasetWriter(os.path.join(tmp, split), tokenizer.TOKEN_DTYPE) as w:
          for rel in splits[split]:
            with open(os.path.join(root, rel), "rb") as f:
              w.add_document(tokenizer.encode(f.read(), append_eod=True))
            bar.update(1)
    try:
      os.rename(tmp, final)
    except OSError:
      if not all(megatron.exists(p) for p in prefixes.values()):
        raise  # not a concurrent builder winning the race
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return prefixes

