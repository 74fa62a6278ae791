"""Chat templates: conversations as text, and which of its characters the model should learn.

A Hugging Face tokenizer directory carries its chat template as ``chat_template.jinja`` or
as ``chat_template`` in ``tokenizer_config.json``: a Jinja program that turns
``messages = [{"role": ..., "content": ...}, ...]`` into the text the model was trained
on. It is rendered here as transformers renders it (a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, the tokenizer's special tokens as variables,
``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII), so the text,
and hence the tokens, are the ones ``apply_chat_template`` gives.

What the model learns of a conversation are its assistant turns (:meth:`ChatTemplate.spans`):

- where the template marks them with ``{% generation %} ... {% endgeneration %}`` (as
  for transformers' ``return_assistant_tokens_mask``), exactly the marked text;
- otherwise, for assistant message i, the text from the end of the generation prompt
  (the conversation up to message i rendered with ``add_generation_prompt=True``, which
  must begin the whole conversation's text) through the end-of-sequence token that
  closes the turn (``<|im_end|>``, ``<|eot_id|>``...): the first one after the message's
  content (and after any tool calls the template writes there), before the next
  assistant turn; without one, through the end of the content. Where the template
  does not write the content verbatim (Qwen3 keeps only the answer of a turn before the
  last user message), or there is none (a turn of tool calls only), the eos is looked
  for from the turn's start.

So a turn's targets are what the model must generate at inference: any text the
template opens the turn with (Qwen3's empty ``<think>`` block), the content, and the token
that stops generation.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from typing import Any

from data.errors import DataError

# Private-use characters that bracket the output of {% generation %} blocks while
# rendering; they are removed from the text and give the learned spans.
_OPEN, _CLOSE = "\ue000", "\ue001"


class ChatTemplate:
  """A compiled chat template with its tokenizer's special tokens.

  Attributes:
    source: the Jinja text.
    special_tokens: ``bos_token``, ``eos_token``... -> their text, passed to the template.
  """

  def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
    # Imported here: only fine-tuning on conversations needs Jinja.
    import jinja2
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(ext.Extension):
      """``{% generation %}body{% endgeneration %}``: the body, bracketed by markers."""
      tags = {"generation"}

      def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

      def _mark(self, caller):
        return _OPEN + caller() + _CLOSE

    def raise_exception(message):
      raise DataError(f"the chat template refuses the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateError as e:
      raise DataError(f"the chat template does not compile: {e}") from None
    self.source = source
    self.special_tokens = dict(special_tokens or {})

  @classmethod
  def from_directory(cls, directory: str) -> ChatTemplate | None:
    """The template of a tokenizer directory (``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json``), None if it has none."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
      with open(config_path) as f:
        config = json.load(f)
    special = {}
    for key, value in config.items():
      value = value.get("content") if isinstance(value, dict) else value
      if key.endswith("_token") and isinstance(value, str):
        special[key] = value
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
      with open(jinja_path) as f:
        return cls(f.read(), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
      source = {t.get("name"): t.get("template") for t in source}.get("default")
    return cls(source, special) if isinstance(source, str) else None

  def _render(self, messages: list[dict], add_generation_prompt: bool, marked: bool,
              tools: list[dict] | None = None) -> str:
    import jinja2

    try:
      # tools and documents are always passed, None when absent, as transformers does.
      text = self._template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.special_tokens)
    except jinja2.TemplateError as e:
      raise DataError(f"the chat template fails on the conversation: {e}") from None
    return text if marked else text.replace(_OPEN, "").replace(_CLOSE, "")

  def render(self, messages: list[dict], add_generation_prompt: bool = False,
             tools: list[dict] | None = None) -> str:
    """The conversation's text, as ``apply_chat_template(..., tokenize=False)`` gives it;
    ``tools``: the JSON schemas of the functions the assistant may call."""
    return self._render(messages, add_generation_prompt, marked=False, tools=tools)

  def spans(self, messages: list[dict], eos: str | None = None, tools: list[dict] | None = None
            ) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the conversation's text and the ``[start, end)`` character ranges
    of it that the model learns (module docstring); ``eos`` is the text of the token that
    ends a turn."""
    marked = self._render(messages, False, marked=True, tools=tools)
    if _OPEN in marked:
      return _strip_marks(marked)
    text = marked
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    starts = []
    for i in turns:
      prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
      if not text.startswith(prompt):
        raise DataError(f"the chat template renders the turns before assistant message {i}"
                        " differently from the whole conversation, so its start is unknown;"
                        " use prompt/completion lines")
      starts.append(len(prompt))
    ends = [_turn_end(text, start, (messages[i].get("content") or "").strip(), limit, eos, i)
            for i, start, limit in zip(turns, starts, starts[1:] + [len(text)])]
    return text, list(zip(starts, ends))


def _turn_end(text: str, start: int, content: str, limit: int, eos: str | None, index: int) -> int:
  """Where the assistant turn that starts at ``start`` ends: at the end of the first eos
  after its content (after its tool calls too) and before ``limit``, the next assistant
  turn's start; without one, at the end of its content. A content the template does not
  write verbatim (Qwen3 drops earlier turns' reasoning), or none (a turn of tool calls),
  counts from the turn's start."""
  found = text.find(content, start) if content else -1
  after = found + len(content) if found >= 0 else start
  close = text.find(eos, after, limit) if eos else -1
  if close >= 0:
    return close + len(eos)
  if found >= 0:
    return after
  raise DataError(f"the chat template does not write assistant message {index}'s content"
                  " verbatim, nor an end-of-sequence token after it; use prompt/completion lines")


def _strip_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
  """The text without the generation markers, and the ranges they enclosed."""
  pieces, spans, length = re.split(f"([{_OPEN}{_CLOSE}])", marked), [], 0
  start = None
  for piece in pieces:
    if piece == _OPEN:
      start = length
    elif piece == _CLOSE:
      spans.append((start, length))
    else:
      length += len(piece)
  return "".join(p for p in pieces if p not in (_OPEN, _CLOSE)), spans


def check_tools(tools: Any) -> list[dict] | None:
  """``tools`` if it is absent (None) or a list of JSON schemas (objects), else a DataError."""
  if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
    raise DataError("\"tools\" must be a list of JSON schema objects")
  return tools


def check_messages(messages: Any) -> list[dict]:
  """``messages`` if it is a conversation with an assistant turn, else a DataError."""
  if not isinstance(messages, list) or not messages:
    raise DataError("\"messages\" must be a non-empty list of {\"role\", \"content\"} objects")
  for k, m in enumerate(messages):
    calls = isinstance(m, dict) and m.get("tool_calls") and m.get("content") is None  # calls alone
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (isinstance(m.get("content"), str) or calls):
      raise DataError(f"message {k} must be an object with \"role\" and \"content\" strings"
                      " (\"content\" may be null beside \"tool_calls\")")
  if not any(m["role"] == "assistant" for m in messages):
    raise DataError("the conversation has no \"assistant\" message, so nothing to learn")
  return messages
