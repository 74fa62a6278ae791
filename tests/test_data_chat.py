"""Chat templates: the text and tokens of a conversation are transformers' own, and the
learned tokens are exactly the assistant turns (with the token that ends them)."""
import json

import numpy as np
import pytest

import data
from data import chat, hf_tokenizer

transformers = pytest.importorskip("transformers", reason="the Hugging Face reference tests need the dev extra: pip install -e \".[dev]\"")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's rule: assistant turns after the last user message open with an empty think block.
QWEN3 = ("{% set ns = namespace(last=0) %}"
         "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}"
         "{% if m['role'] == 'assistant' and loop.index0 > ns.last %}"
         "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
         "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}")
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hello, how are you?"},
    {"role": "user", "content": "What is the answer?"},
    {"role": "assistant", "content": "The answer is 42."},
]


def make_chat_tokenizer(directory, template: str, eos: str = "<|im_end|>") -> None:
  """A small byte-level BPE ``tokenizer.json`` with the chat special tokens, and
  ``tokenizer_config.json`` holding ``template``."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = " ".join(m["content"] for m in CONVERSATION) + " system user assistant think"
  tok.train_from_iterator([text] * 4, trainers.BpeTrainer(
      vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": eos, "bos_token": "<|begin_of_text|>", "chat_template": template}))


def _hf(directory):
  return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))


def _learned_runs(tokenizer, ids, learn) -> list[str]:
  """The text of each maximal run of learned tokens."""
  runs, edges = [], np.flatnonzero(np.diff(np.concatenate([[0], learn.astype(int), [0]])))
  for start, end in zip(edges[::2], edges[1::2]):
    runs.append(tokenizer.decode(ids[start:end]))
  return runs


@pytest.mark.parametrize("template, eos, turns", [
    (CHATML, "<|im_end|>", ["hello, how are you?<|im_end|>", "The answer is 42.<|im_end|>"]),
    (QWEN3, "<|im_end|>", ["hello, how are you?<|im_end|>",
                           "<think>\n\n</think>\n\nThe answer is 42.<|im_end|>"]),
    (LLAMA3, "<|eot_id|>", ["hello, how are you?<|eot_id|>", "The answer is 42.<|eot_id|>"]),
], ids=["chatml", "qwen3", "llama3"])
def test_conversation_tokens_are_transformers_and_assistant_turns_are_learned(tmp_path, template, eos, turns):
  make_chat_tokenizer(tmp_path, template, eos)
  ours, theirs = hf_tokenizer.load(str(tmp_path)), _hf(tmp_path)
  ids, learn = ours.encode_chat(CONVERSATION)
  assert ours.chat.render(CONVERSATION) == theirs.apply_chat_template(CONVERSATION, tokenize=False)
  assert list(ids) == list(theirs.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"])
  assert ours.chat.render(CONVERSATION[:2], add_generation_prompt=True) == theirs.apply_chat_template(
      CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
  assert _learned_runs(ours, ids, learn) == turns


# Qwen-style: the tools' schemas in a system block, only when there are tools.
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
                  "{% endif %}" + CHATML)
TOOLS = [{"type": "function", "function": {"name": "answer", "description": "the answer, é",
                                           "parameters": {"type": "object", "properties": {}}}}]


def test_tools_reach_the_template_as_in_transformers(tmp_path):
  make_chat_tokenizer(tmp_path, TOOLS_TEMPLATE)
  ours, theirs = hf_tokenizer.load(str(tmp_path)), _hf(tmp_path)
  for tools in (TOOLS, None):
    assert ours.chat.render(CONVERSATION, tools=tools) == theirs.apply_chat_template(
        CONVERSATION, tools=tools, tokenize=False)
  path = tmp_path / "tools.jsonl"
  path.write_text(json.dumps({"messages": CONVERSATION, "tools": TOOLS}) + "\n")
  (tokens, learn), = data.load_source(f"sft:{path}", tokenizer=ours).examples
  assert ours.decode(tokens).startswith("<|im_start|>system\n{\"type\": \"function\"")
  assert _learned_runs(ours, tokens, learn) == ["hello, how are you?<|im_end|>", "The answer is 42.<|im_end|>"]
  path.write_text(json.dumps({"messages": CONVERSATION, "tools": "answer"}) + "\n")
  with pytest.raises(data.DataError, match="tools.jsonl:1: \"tools\" must be a list"):
    data.load_source(f"sft:{path}", tokenizer=ours)


# Tool calls written after the content, as Qwen's template writes them.
CALLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
                  "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_calls_are_learned_with_their_turn(tmp_path):
  make_chat_tokenizer(tmp_path, CALLS_TEMPLATE)
  call = {"type": "function", "function": {"name": "answer", "arguments": {}}}
  conversation = [
      {"role": "user", "content": "What is the answer?"},
      {"role": "assistant", "content": None, "tool_calls": [call]},
      {"role": "tool", "content": "42"},
      {"role": "assistant", "content": "hello, how are you?", "tool_calls": [call]},
      {"role": "tool", "content": "fine"},
      {"role": "assistant", "content": "The answer is 42."},
  ]
  ours = hf_tokenizer.load(str(tmp_path))
  ids, learn = ours.encode_chat(conversation)
  assert list(ids) == list(_hf(tmp_path).apply_chat_template(conversation, tokenize=True)["input_ids"])
  written = '<tool_call>{"name": "answer", "arguments": {}}</tool_call><|im_end|>'
  assert _learned_runs(ours, ids, learn) == [written, "hello, how are you?" + written, "The answer is 42.<|im_end|>"]


def test_generation_blocks_give_transformers_assistant_mask(tmp_path):
  make_chat_tokenizer(tmp_path, MARKED)
  ids, learn = hf_tokenizer.load(str(tmp_path)).encode_chat(CONVERSATION)
  theirs = _hf(tmp_path).apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
  assert list(ids) == list(theirs["input_ids"])
  assert list(learn.astype(int)) == list(theirs["assistant_masks"])
  assert learn.sum() > 0


def test_turns_the_template_rewrites_end_at_their_eos(tmp_path):
  """Like Qwen3 for turns before the last user message: only the answer after the
  reasoning is written, so the content is not found verbatim."""
  make_chat_tokenizer(tmp_path, CHATML.replace("{{ m['content'] }}", "{{ m['content'].split('</think>')[-1] }}"))
  tokenizer = hf_tokenizer.load(str(tmp_path))
  conversation = [dict(m) for m in CONVERSATION]
  conversation[2]["content"] = "<think>greet back</think>hello, how are you?"
  ids, learn = tokenizer.encode_chat(conversation)
  assert _learned_runs(tokenizer, ids, learn) == ["hello, how are you?<|im_end|>", "The answer is 42.<|im_end|>"]


def test_template_from_jinja_file_and_named_list(tmp_path):
  (tmp_path / "chat_template.jinja").write_text(CHATML)
  assert chat.ChatTemplate.from_directory(str(tmp_path)).source == CHATML
  (tmp_path / "chat_template.jinja").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "tool_use", "template": LLAMA3}, {"name": "default", "template": CHATML}]}))
  assert chat.ChatTemplate.from_directory(str(tmp_path)).source == CHATML
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  assert chat.ChatTemplate.from_directory(str(tmp_path)) is None


@pytest.mark.parametrize("template, messages, error", [
    (CHATML, [{"role": "user", "content": "hi"}], "no \"assistant\" message"),
    (CHATML, [{"role": "user"}, {"role": "assistant", "content": "x"}], "message 0 must be an object"),
    (CHATML, "hello", "non-empty list"),
    # numbering turns from the end renders every prefix differently
    ("{% for m in messages %}[{{ loop.revindex }}] {{ m['content'] }}{% endfor %}", CONVERSATION,
     "renders the turns before assistant message 2 differently"),
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
     "{% if add_generation_prompt %}assistant: {% endif %}", CONVERSATION, "verbatim, nor an end-of-sequence"),
    ("{{ raise_exception('no system messages') }}", CONVERSATION, "refuses the conversation: no system"),
])
def test_bad_conversations_are_named(tmp_path, template, messages, error):
  make_chat_tokenizer(tmp_path, template)
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"messages": messages}) + "\n")
  with pytest.raises(data.DataError, match=f"chat.jsonl:2: .*{error}"):
    data.load_source(f"sft:{path}", tokenizer=hf_tokenizer.load(str(tmp_path)))


def test_conversations_need_a_template(tmp_path):
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
  with pytest.raises(data.DataError, match="chat.jsonl:1: conversations need a Hugging Face tokenizer"):
    data.load_source(f"sft:{path}")
  make_chat_tokenizer(tmp_path, CHATML)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  del config["chat_template"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(data.DataError, match="chat.jsonl:1: the tokenizer has no chat template"):
    data.load_source(f"sft:{path}", tokenizer=hf_tokenizer.load(str(tmp_path)))
  with pytest.raises(data.DataError, match="does not compile"):
    chat.ChatTemplate("{% for m in messages %}")


def test_conversation_rows_pack_with_prompt_completion_lines(tmp_path):
  """One file may mix both forms; a conversation's targets are its learned tokens."""
  make_chat_tokenizer(tmp_path, CHATML)
  tokenizer = hf_tokenizer.load(str(tmp_path))
  path = tmp_path / "mixed.jsonl"
  path.write_text(json.dumps({"messages": CONVERSATION}) + "\n"
                  + json.dumps({"prompt": "hello", "completion": " there"}) + "\n")
  source = data.load_source(f"sft:{path}", tokenizer=tokenizer)
  ids, learn = tokenizer.encode_chat(CONVERSATION)
  rows = source.rows(len(ids) + 8)
  assert len(rows["inputs"]) == 1 and list(rows["segment_ids"][0, :len(ids)]) == [1] * (len(ids) - 1) + [2]
  targets = rows["targets"][0, :len(ids) - 1]
  np.testing.assert_array_equal(targets, np.where(learn[1:], ids[1:], -1))
  assert [tokenizer.decode(targets[targets >= 0])] == ["hello, how are you?<|im_end|>The answer is 42.<|im_end|>"]
