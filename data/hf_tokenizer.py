"""Hugging Face tokenizers (``tokenizer.json``) through the ``tokenizers`` library.

A checkpoint directory's ``tokenizer.json`` encodes text; its end-of-document token is the
``eos_token`` of ``tokenizer_config.json``, else the ``eos_token_id`` of ``config.json``.
The byte tokenizer (``data/tokenizer.py``) stays the default everywhere; this one serves
``--init-from hf:DIR`` runs and ``python -m data.convert tokenize --tokenizer DIR``.
"""
from __future__ import annotations

import json
import os

import numpy as np

from data import tokenizer as byte_tokenizer
from data.chat import ChatTemplate
from data.errors import DataError, DataFileNotFoundError


class HFTokenizer:
  """``encode`` / ``decode`` of a ``tokenizer.json``, with the directory's EOD token.

  Attributes:
    eod: the end-of-document (eos) token id.
    vocab_size: ids are below it.
    chat: the directory's chat template (``data.chat``), None if it has none.
  """

  def __init__(self, directory: str):
    # Imported here: only runs that use a Hugging Face tokenizer load the library.
    from tokenizers import Tokenizer

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
      raise DataFileNotFoundError(f"{directory}: no tokenizer.json (a Hugging Face tokenizer)")
    try:
      self._tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001  the Rust library raises bare Exceptions
      raise DataError(f"{path}: not a tokenizers file ({e})") from None
    self.eod = _eos_id(directory, self._tokenizer)
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    self.chat = ChatTemplate.from_directory(directory)

  def encode(self, text: str | bytes, *, append_eod: bool = False, special: bool = True) -> np.ndarray:
    """Token ids int32 [n]; ``special`` adds the tokenizer's own (e.g. a leading BOS)."""
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    ids = self._tokenizer.encode(text, add_special_tokens=special).ids
    return np.asarray(ids + ([self.eod] if append_eod else []), np.int32)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

  def encode_chat(self, messages: list[dict], tools: list[dict] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32 [n], learn bool [n])`` of a conversation (and the ``tools`` it may
    call) rendered by the chat template: ``learn`` marks the tokens that begin inside an
    assistant turn (``data.chat``). The template writes the special tokens itself, so
    none are added."""
    if self.chat is None:
      raise DataError("the tokenizer has no chat template (chat_template.jinja or chat_template"
                      " in tokenizer_config.json); use prompt/completion lines")
    text, spans = self.chat.spans(messages, self.decode([self.eod]), tools)
    encoding = self._tokenizer.encode(text, add_special_tokens=False)
    starts = np.asarray([start for start, _ in encoding.offsets], np.int64)
    learn = np.zeros(len(starts), bool)
    for start, end in spans:
      learn |= (starts >= start) & (starts < end)
    return np.asarray(encoding.ids, np.int32), learn


class ByteTokenizer:
  """The byte tokenizer behind the same interface as :class:`HFTokenizer`."""

  eod = byte_tokenizer.EOD
  vocab_size = byte_tokenizer.VOCAB_SIZE
  chat = None

  def encode(self, text: str | bytes, *, append_eod: bool = False, special: bool = True) -> np.ndarray:
    del special
    return byte_tokenizer.encode(text, append_eod=append_eod).astype(np.int32)

  def decode(self, ids) -> str:
    return byte_tokenizer.decode(ids)

  def encode_chat(self, messages: list[dict], tools: list[dict] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    del messages, tools
    raise DataError("conversations need a Hugging Face tokenizer with a chat template"
                    " (--init-from hf:DIR); the byte tokenizer has none")


def load(directory: str | None) -> HFTokenizer | ByteTokenizer:
  """``directory``'s tokenizer, or the byte tokenizer when None."""
  return ByteTokenizer() if directory is None else HFTokenizer(directory)


def _eos_id(directory: str, tok) -> int:
  config = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(config):
    with open(config) as f:
      eos = json.load(f).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
      return int(tok.token_to_id(eos))
  model_config = os.path.join(directory, "config.json")
  if os.path.isfile(model_config):
    with open(model_config) as f:
      eos = json.load(f).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int):
      return eos
  raise DataError(f"{directory}: no end-of-document token (eos_token in tokenizer_config.json"
                  " or eos_token_id in config.json)")
