"""Byte-level tokenizer: token i < 256 is the byte i, token 256 ends a document.

Any file is a valid input (no decoding, no unknown tokens), so the embedded corpus and
`python -m data.convert tokenize` need no vocabulary file. Token ids are stored as uint16.
The embedding table is padded so that tensor parallelism divides it (`padded_vocab_size`).
"""
import numpy as np

EOD = 256  # end of document
VOCAB_SIZE = 257
TOKEN_DTYPE = np.uint16


def encode(data, *, append_eod=False):
  """Tokens of `data` (str, encoded as UTF-8, or bytes) as a uint16 array [len(bytes)(+1)]."""
  if isinstance(data, str):
    data = data.encode("utf-8")
  tokens = np.frombuffer(bytes(data), dtype=np.uint8).astype(TOKEN_DTYPE)
  if append_eod:
    tokens = np.append(tokens, TOKEN_DTYPE(EOD))
  return tokens


def decode(tokens):
  """Text of `tokens`; EOD shows as `<|endoftext|>`, padding ids (> 256) as U+FFFD."""
  parts, run = [], bytearray()
  for t in np.asarray(tokens).ravel().tolist():
    if t < 256:
      run.append(t)
      continue
    parts.append(run.decode("utf-8", errors="replace"))
    parts.append("<|endoftext|>" if t == EOD else "\ufffd")
    run = bytearray()
  parts.append(run.decode("utf-8", errors="replace"))
  return "".join(parts)


def padded_vocab_size(vocab_size=VOCAB_SIZE, *, multiple_of=128, tp=1):
  """Smallest multiple of `multiple_of * tp` that is >= `vocab_size` (as Megatron pads).

  The extra rows of the embedding and LM head are never targets; they only make the
  vocab axis divisible by the tensor-parallel size with aligned shards.
  """
  step = multiple_of * tp
  return -(-vocab_size // step) * step
