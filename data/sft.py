"""Fine-tuning data: ``sft:FILE.jsonl``, one example per line, in either form:

- ``{"prompt": ..., "completion": ...}``: the tokens ``prompt + completion + [EOD]``; the
  model learns the completion and the EOD;
- ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}``: a
  conversation, rendered by the tokenizer's chat template (``data.chat``; a Hugging Face
  tokenizer is needed) with the line's ``"tools"`` (JSON schemas) if it has them; the
  model learns its assistant turns.

An example is its tokens and which of them are learned; its inputs are all tokens but
the last, its targets all but the first, and a target that is not learned is -1 (not
counted by the loss).

Packing (:func:`pack`, ``data/packing.py``) lays examples one after another into rows of
``seq_len`` positions, in file order, starting a new row when the next example does not fit
(an example longer than a row is cut to it), with segment ids and restarted positions, so a
packed row gives each of its examples the loss it would have alone. Without packing, each
example gets a row of its own.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from data import chat, packing
from data.errors import DataError, DataFileNotFoundError


@dataclasses.dataclass(frozen=True)
class SFTSource:
  """Tokenized examples of a fine-tuning file.

  Attributes:
    name: the spec it was loaded from.
    examples: per example, (tokens int32 [n], learn bool [n]): the targets the model learns.
    vocab_size: the tokenizer's.
    packed: several examples per row (:func:`pack`), else one.
  """
  name: str
  examples: tuple[tuple[np.ndarray, np.ndarray], ...]
  vocab_size: int
  packed: bool = True

  def rows(self, seq_len: int) -> dict[str, np.ndarray]:
    return pack(self.examples, seq_len, self.packed)


def read(path: str, tokenizer, *, packed: bool = True, name: str | None = None) -> SFTSource:
  """Tokenizes ``path``'s lines with ``tokenizer`` (``data.hf_tokenizer``'s interface)."""
  if not os.path.isfile(path):
    raise DataFileNotFoundError(f"{path}: no such fine-tuning file (sft:FILE.jsonl)")
  examples = []
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        examples.append(_example(_record(line), tokenizer))
      except DataError as e:
        raise DataError(f"{path}:{lineno}: {e}") from None
  if not examples:
    raise DataError(f"{path}: no examples")
  return SFTSource(name or f"sft:{path}", tuple(examples), tokenizer.vocab_size, packed)


def _record(line: bytes) -> dict:
  try:
    record = json.loads(line)
  except ValueError:
    record = None
  if not isinstance(record, dict) or not ({"prompt", "completion"} <= record.keys() or "messages" in record):
    raise DataError("expected a JSON object with \"prompt\" and \"completion\" strings,"
                    " or with \"messages\" (a conversation)")
  return record


def _example(record: dict, tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, learn) of one line's record."""
  if "messages" in record:
    return tokenizer.encode_chat(chat.check_messages(record["messages"]), chat.check_tools(record.get("tools")))
  prompt, completion = record["prompt"], record["completion"]
  if not isinstance(prompt, str) or not isinstance(completion, str):
    raise DataError("\"prompt\" and \"completion\" must be strings")
  p = tokenizer.encode(prompt)
  c = tokenizer.encode(completion, append_eod=True, special=False)
  tokens = np.concatenate([p, c]).astype(np.int32)
  return tokens, np.arange(len(tokens)) >= len(p)


def example_row(tokens: np.ndarray, learn: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of one example, cut to ``seq_len`` positions; targets not learned -1."""
  inputs, targets = tokens[:-1].copy(), tokens[1:].copy()
  targets[~learn[1:]] = -1
  return inputs[:seq_len], targets[:seq_len]


def pack(examples, seq_len: int, packed: bool = True) -> dict[str, np.ndarray]:
  """Rows of ``seq_len`` positions (module docstring; ``data.packing``'s, in file order):
  int32 [R, seq_len] each of ``inputs``, ``targets``, ``segment_ids``, ``positions``."""
  inputs, targets = zip(*(example_row(tokens, learn, seq_len) for tokens, learn in examples))
  lengths_E = np.asarray([len(x) for x in inputs])
  if packed:
    row_E, start_E = packing.next_fit(lengths_E, seq_len)
  else:
    row_E, start_E = np.arange(len(lengths_E)), np.zeros(len(lengths_E), np.int64)
  return packing.fill(list(inputs), list(targets), row_E, start_E, int(row_E[-1]) + 1, seq_len)
