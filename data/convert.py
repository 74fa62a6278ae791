"""Convert token data between formats: `python -m data.convert --help`.

  fineweb-to-megatron  FineWeb `.bin` shards -> one Megatron dataset, cut into sequences of
                       seq_len + 1 tokens, one document each, the tail dropped (as
                       Megatron-Dion's tools/convert_dion_to_megatron.py does).
  tokenize             text files (one document each) or JSONL files (one document per
                       line, from a string field) -> a Megatron dataset or FineWeb shards,
                       with the byte tokenizer or, with --tokenizer DIR, a Hugging Face
                       tokenizer.json; every document ends with the EOD (eos) token.

Outputs are written into a temporary folder beside them and renamed into place only when
everything succeeded: a failed or interrupted conversion leaves nothing behind. Bad input
exits with status 2 (as the ``train`` commands), a failed write (disk full,
permissions) with 1 and a Ctrl-C with 130, each with a one-line `error: ...` on stderr.

Examples:
  python -m data.convert fineweb-to-megatron --input 'fineweb10B/fineweb_train_*.bin' \\
      --output-prefix megatron/fineweb_train --sequence-length 1024
  python -m data.convert tokenize notes.txt corpus.jsonl --output-prefix out/mydata
  python -m data.convert tokenize corpus.jsonl --format fineweb --output-prefix out/mydata
  python -m data.convert tokenize corpus.jsonl --tokenizer Qwen3-0.6B --output-prefix out/qwen
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile

import numpy as np

from data import fineweb, hf_tokenizer, megatron
from data.errors import DataError, DataFileNotFoundError
from data.progress import Progress


@contextlib.contextmanager
def atomic_outputs(directory: str):
  """Yields a temporary folder inside `directory`; moves its files there only on success."""
  directory = directory or "."
  os.makedirs(directory, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".convert-", dir=directory)
  try:
    yield tmp
    for name in sorted(os.listdir(tmp)):
      os.replace(os.path.join(tmp, name), os.path.join(directory, name))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def check_output_prefix(prefix: str) -> None:
  """Raises DataError unless ``prefix`` names files in a folder that is one or can be made:
  not a folder itself (``out/`` would write ``out/.bin``), not under a file."""
  directory, base = os.path.split(prefix)
  if not base or base in (".", ".."):
    raise DataError(f"--output-prefix {prefix}: names a folder, not the files' name; add one,"
                    f" e.g. {os.path.join(prefix, 'mydata')}")
  existing = directory or "."
  while not os.path.exists(existing):
    existing = os.path.dirname(existing) or "."
  if not os.path.isdir(existing):
    raise DataError(f"--output-prefix {prefix}: {existing} is a file, not a folder")


class ShardWriter:
  """FineWeb counterpart of `megatron.IndexedDatasetWriter`: `PREFIX_000000.bin`, ..."""

  def __init__(self, prefix: str, shard_tokens: int):
    self.prefix, self.shard_tokens = prefix, shard_tokens
    self._buffer: list[np.ndarray] = []
    self._buffered = self._shards = 0

  def add_document(self, tokens) -> None:
    self._buffer.append(np.asarray(tokens))
    self._buffered += len(tokens)
    while self._buffered >= self.shard_tokens:
      self._flush(self.shard_tokens)

  def _flush(self, count: int) -> None:
    flat = np.concatenate(self._buffer)
    fineweb.write_shard(f"{self.prefix}_{self._shards:06d}.bin", flat[:count])
    self._buffer, self._buffered = [flat[count:]], len(flat) - count
    self._shards += 1

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is None and self._buffered:
      self._flush(self._buffered)


def fineweb_to_megatron(pattern: str, output_prefix: str, *, sequence_length: int = 1024,
                        progress: bool = True) -> dict:
  """Concatenates the shards matching `pattern` into `output_prefix`.{bin,idx}."""
  if sequence_length < 1:
    raise DataError(f"--sequence-length must be positive, got {sequence_length}")
  check_output_prefix(output_prefix)
  paths = fineweb.shard_paths(pattern)
  counts = [fineweb.read_header(p) for p in paths]
  per_seq = sequence_length + 1
  if sum(counts) < per_seq:
    raise DataError(f"{pattern}: {sum(counts)} tokens make no sequence of {per_seq}")
  directory, base = os.path.split(output_prefix)
  carry = np.zeros(0, fineweb.TOKEN_DTYPE)
  with atomic_outputs(directory) as tmp, \
       Progress("converting", sum(counts), "tokens", enabled=progress) as bar, \
       megatron.IndexedDatasetWriter(os.path.join(tmp, base), np.uint16) as writer:
    for path, count in zip(paths, counts):
      carry = np.concatenate([carry, fineweb.read_shard(path)])
      n = len(carry) // per_seq
      writer.add_document(carry[:n * per_seq], np.full(n, per_seq))
      carry = carry[n * per_seq:]
      bar.update(count)
  return {"inputs": len(paths), "documents": writer.num_documents,
          "tokens": writer.num_documents * per_seq, "dropped tokens": len(carry),
          "outputs": [megatron.bin_path(output_prefix), megatron.idx_path(output_prefix)]}


def read_documents(path: str, json_key: str):
  """Yields (document bytes, input bytes consumed): JSONL lines' `json_key`, else the file."""
  if not os.path.isfile(path):
    raise DataFileNotFoundError(f"{path}: no such input file")
  if not path.endswith((".jsonl", ".ndjson")):
    with open(path, "rb") as f:
      data = f.read()
    yield data, len(data)
    return
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        yield b"", len(line)
        continue
      try:
        text = json.loads(line)[json_key]
      except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}:{lineno}: no JSON object with a {json_key!r} field "
                        f"({type(e).__name__})") from None
      if not isinstance(text, str):
        raise DataError(f"{path}:{lineno}: field {json_key!r} is not a string")
      yield text.encode("utf-8"), len(line)


def tokenize(inputs: list[str], output_prefix: str, *, output_format: str = "megatron",
             json_key: str = "text", shard_tokens: int = 100_000_000,
             progress: bool = True, tokenizer_dir: str | None = None) -> dict:
  """Tokenizes `inputs` (bytes, or `tokenizer_dir`'s tokenizer.json) into a Megatron
  dataset or FineWeb shards `PREFIX_000000.bin`."""
  if output_format == "fineweb" and shard_tokens < 1:
    raise DataError(f"--shard-tokens must be positive, got {shard_tokens}")
  check_output_prefix(output_prefix)
  missing = [p for p in inputs if not os.path.isfile(p)]
  if missing:
    raise DataFileNotFoundError(f"{missing[0]}: no such input file")
  tok = hf_tokenizer.load(tokenizer_dir)
  if output_format == "fineweb" and tok.vocab_size > 2**16:
    raise DataError(f"{tokenizer_dir}: {tok.vocab_size} tokens do not fit FineWeb's uint16;"
                    " use --format megatron")
  directory, base = os.path.split(output_prefix)
  docs = tokens = 0
  with atomic_outputs(directory) as tmp, Progress(
      "tokenizing", sum(os.path.getsize(p) for p in inputs), "bytes", enabled=progress) as bar:
    if output_format == "megatron":
      writer = megatron.IndexedDatasetWriter(
          os.path.join(tmp, base), megatron.dtype_for_vocab(tok.vocab_size))
    else:
      writer = ShardWriter(os.path.join(tmp, base), shard_tokens)
    with writer:
      for path in inputs:
        for doc, consumed in read_documents(path, json_key):
          bar.update(consumed)
          if doc:
            ids = tok.encode(doc, append_eod=True)
            writer.add_document(ids.astype(megatron.dtype_for_vocab(tok.vocab_size)))
            docs, tokens = docs + 1, tokens + len(ids)
      if docs == 0:
        raise DataError(f"{inputs[0] if inputs else output_prefix}: no non-empty documents "
                        f"in {_count(len(inputs), 'input file')}")
    outputs = sorted(os.listdir(tmp))
  return {"inputs": len(inputs), "documents": docs, "tokens": tokens,
          "outputs": [os.path.join(directory, n) for n in outputs]}


def _count(n: int, noun: str) -> str:
  """``n`` and its noun, in the plural unless one: "1 document", "2,048 tokens"."""
  return f"{n:,} {noun}{'' if n == 1 else 's'}"


class _Parser(argparse.ArgumentParser):
  """Bad flags end with one ``error: ...`` line and exit code 2, as the ``train.*`` commands'
  (``train/cli.py``), where argparse printed its usage too; the commands' parsers are of this
  class as well."""

  def error(self, message):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog="python -m data.convert", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
  commands = parser.add_subparsers(dest="command", required=True)
  fw = commands.add_parser(
      "fineweb-to-megatron", parents=[common],
      help="FineWeb .bin shards -> a Megatron .bin/.idx dataset",
      description="Concatenate FineWeb shards (sorted by name) and cut the tokens into "
                  "sequences of SEQUENCE_LENGTH + 1, each one Megatron document.")
  fw.add_argument("--input", required=True, metavar="GLOB",
                  help="shard glob, quoted, e.g. 'data/fineweb_train_*.bin'")
  fw.add_argument("--output-prefix", required=True, metavar="PREFIX",
                  help="writes PREFIX.bin and PREFIX.idx")
  fw.add_argument("--sequence-length", type=int, default=1024,
                  help="training sequence length; sequences hold one more token "
                       "(default: %(default)s)")
  tok = commands.add_parser(
      "tokenize", parents=[common],
      help="text / JSONL files -> Megatron dataset or FineWeb shards (bytes)",
      description="Byte-tokenize documents: a .jsonl/.ndjson file holds one JSON object per "
                  "line, any other file is one document. Token 256 ends each document.")
  tok.add_argument("inputs", nargs="+", metavar="FILE", help="input files")
  tok.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="megatron: PREFIX.bin + PREFIX.idx; fineweb: PREFIX_000000.bin, ...")
  tok.add_argument("--format", choices=("megatron", "fineweb"), default="megatron",
                   help="output format (default: %(default)s)")
  tok.add_argument("--json-key", default="text",
                   help="JSONL field holding the text (default: %(default)s)")
  tok.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="a Hugging Face tokenizer directory (tokenizer.json; its eos token ends"
                        " each document) instead of bytes")
  tok.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="fineweb: tokens per shard (default: %(default)s)")
  return parser


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  progress = not args.quiet
  try:
    if args.command == "fineweb-to-megatron":
      summary = fineweb_to_megatron(args.input, args.output_prefix,
                                    sequence_length=args.sequence_length, progress=progress)
    else:
      summary = tokenize(args.inputs, args.output_prefix, output_format=args.format,
                         json_key=args.json_key, shard_tokens=args.shard_tokens,
                         progress=progress, tokenizer_dir=args.tokenizer)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print(f"error: interrupted; nothing was written to {args.output_prefix}*", file=sys.stderr)
    return 128 + 2  # SIGINT's number, as a shell reports a Ctrl-C
  written = sum(os.path.getsize(p) for p in summary["outputs"])
  print(f"{_count(summary['inputs'], 'input file')} -> {_count(summary['documents'], 'document')}, "
        f"{_count(summary['tokens'], 'token')}, {_count(written, 'byte')} written:")
  if "dropped tokens" in summary:
    print(f"  ({summary['dropped tokens']:,} trailing tokens dropped, short of a sequence)")
  for path in summary["outputs"]:
    print(f"  {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
