"""Token sources by name: the embedded corpus, FineWeb shards, Megatron datasets, blends.

A spec is one of
  "stdlib" or "stdlib:train", "stdlib:val"   the embedded corpus (`data.corpus`)
  "dir/fineweb_train_*.bin"                  FineWeb shards (a glob or one file)
  "dir/prefix"                               a Megatron dataset (`dir/prefix.idx` exists;
                                             "dir/prefix.idx" or ".bin" also work)
  "0.7:specA,0.3:specB"                      a blend by weights (Megatron's BlendedDataset)
  "sft:FILE.jsonl"                           fine-tuning examples (`data.sft`), tokenized
                                             on load with the given tokenizer

`load_source(spec)` opens the files (memory maps, nothing is read) and returns a
`TokenSource` or a `Blend` for `data.loader.make_loader`.
"""
import dataclasses
import glob
import os

import numpy as np

from data import corpus, fineweb, megatron, sft, tokenizer
from data.hf_tokenizer import ByteTokenizer
from data.errors import DataError, DataFileNotFoundError


@dataclasses.dataclass(frozen=True)
class TokenSource:
  """Token streams of one data set.

  Attributes:
    name: the spec it was loaded from (for messages).
    streams: 1-D token arrays (memmaps); a training window never crosses from one to the
      next (FineWeb: one per shard; Megatron and the embedded corpus: the whole `.bin`,
      documents separated by their end-of-document tokens).
    vocab_size: token ids are below it; None when the format does not record it (Megatron
      datasets: pass the tokenizer's vocab size to the trainer).
  """
  name: str
  streams: tuple[np.ndarray, ...]
  vocab_size: int | None

  @property
  def num_tokens(self) -> int:
    return sum(len(s) for s in self.streams)


@dataclasses.dataclass(frozen=True)
class Blend:
  """Sources mixed in proportion to `weights` (normalized; all positive)."""
  sources: tuple[TokenSource, ...]
  weights: tuple[float, ...]

  @property
  def name(self) -> str:
    return ",".join(f"{w:g}:{s.name}" for s, w in zip(self.sources, self.weights))

  @property
  def vocab_size(self) -> int | None:
    sizes = [s.vocab_size for s in self.sources]
    return None if None in sizes else max(sizes)


def load_source(spec: str, *, cache_dir: str | None = None, progress: bool = True,
                tokenizer=None, packed: bool = True) -> TokenSource | Blend | sft.SFTSource:
  """Opens the data named by `spec` (see the module docstring).

  Args:
    spec: source spec.
    cache_dir: cache for the embedded corpus (default `$DION_JAX_CACHE` or
      `~/.cache/dion_jax`); built there on first use.
    progress: progress bar on stderr while the embedded corpus builds.
    tokenizer: what tokenizes ``sft:`` files (``data.hf_tokenizer``; default bytes).
    packed: pack ``sft:`` examples several per row.

  Raises:
    DataError: a malformed spec or file; DataFileNotFoundError: a missing path.
  """
  if spec.startswith("sft:"):
    return sft.read(spec[len("sft:"):], tokenizer or ByteTokenizer(), packed=packed, name=spec)
  parts = [p.strip() for p in spec.split(",")]
  weighted = [_split_weight(p) for p in parts]
  if len(parts) == 1 and weighted[0][0] is None:
    return _load_one(spec.strip(), cache_dir, progress)
  if any(w is None for w, _ in weighted):
    raise DataError(f"{spec}: every part of a blend needs a weight, as in '0.7:a,0.3:b'")
  if any(w <= 0 for w, _ in weighted):
    raise DataError(f"{spec}: blend weights must be positive")
  total = sum(w for w, _ in weighted)
  sources = tuple(_load_one(s, cache_dir, progress) for _, s in weighted)
  return Blend(sources, tuple(w / total for w, _ in weighted))


def _split_weight(part: str) -> tuple[float | None, str]:
  head, _, rest = part.partition(":")
  try:
    return float(head), rest.strip()
  except ValueError:
    return None, part


# What a text or JSONL file given as token data needs.
UNTOKENIZED = ("text or JSONL is tokenized first (python -m data.convert tokenize FILE --output-prefix"
               " PREFIX, then the spec PREFIX), and fine-tuning examples are sft:FILE.jsonl")


def _load_one(spec: str, cache_dir: str | None, progress: bool) -> TokenSource:
  if not spec:
    raise DataError("empty data source spec")
  if spec == "stdlib" or spec.startswith("stdlib:"):
    split = spec.partition(":")[2] or "train"
    if split not in corpus.SPLITS:
      raise DataError(f"{spec}: unknown split {split!r}; use {' or '.join('stdlib:' + s for s in corpus.SPLITS)}")
    prefix = corpus.build_corpus(cache_dir=cache_dir, progress=progress)[split]
    ds = megatron.IndexedDataset(prefix)
    return TokenSource(spec, (ds.tokens,), tokenizer.VOCAB_SIZE)
  for prefix in (spec, os.path.splitext(spec)[0]):
    if megatron.exists(prefix):
      return TokenSource(spec, (megatron.IndexedDataset(prefix).tokens,), None)
  if glob.has_magic(spec) or os.path.exists(spec):
    paths = fineweb.shard_paths(spec)
    try:
      return TokenSource(spec, tuple(fineweb.read_shard(p) for p in paths),
                         fineweb.GPT2_VOCAB_SIZE)
    except DataError as e:
      if not os.path.isfile(spec) or spec.endswith(".bin"):
        raise
      raise DataError(f"{e}; {UNTOKENIZED}") from None
  raise DataFileNotFoundError(
      f"{spec}: no such FineWeb shard, shard glob or Megatron prefix (PREFIX.idx)"
      + (f"; {UNTOKENIZED}" if spec.endswith((".jsonl", ".txt", ".json")) else ""))

