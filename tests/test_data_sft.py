"""Fine-tuning data: prompt targets are not counted, and a packed row gives each of its
examples the loss and gradient it has alone."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import models
from data import hf_tokenizer, sft

CFG = models.preset("tiny", num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seq_len=40,
                    mlp="swiglu", qk_norm="rms_scale", rope_base=100.0)
EXAMPLES = [("def f(x):", " return x"), ("1+1=", "2"), ("hello", " world!"), ("abc", "def ghi")]


def _write(tmp_path, examples=EXAMPLES):
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in examples))
  return path


def test_prompt_targets_are_not_counted(tmp_path):
  source = data.load_source(f"sft:{_write(tmp_path)}")
  tokens, learn = source.examples[0]
  assert list(learn) == [False] * len("def f(x):") + [True] * (len(" return x") + 1)
  assert tokens[-1] == data.EOD
  rows = source.rows(CFG.seq_len)
  assert len(rows["inputs"]) == 2  # 18 + 5 + 12 positions fit one row of 40, 10 the next
  counted = rows["targets"][0] >= 0
  # row 0 holds examples 1..3; each counts its completion and EOD targets
  assert counted.sum() == sum(len(c.encode()) + 1 for _, c in EXAMPLES[:3])
  assert list(rows["segment_ids"][0, :19]) == [1] * 18 + [2]
  assert list(rows["positions"][0, 17:20]) == [17, 0, 1]
  unpacked = data.load_source(f"sft:{_write(tmp_path)}", packed=False).rows(CFG.seq_len)
  assert len(unpacked["inputs"]) == len(EXAMPLES)


def test_packed_examples_have_their_unpacked_loss_and_gradient(tmp_path):
  source = data.load_source(f"sft:{_write(tmp_path)}")
  packed = {k: jnp.asarray(v) for k, v in source.rows(CFG.seq_len).items()}
  graphdef, params = models.init(CFG, seed=0)
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b)))
  unpacked = sft.pack(source.examples, CFG.seq_len, packed=False)  # one row each, padded
  for k in range(len(source.examples)):
    alone = {"inputs": jnp.asarray(unpacked["inputs"][k:k + 1]),
             "targets": jnp.asarray(unpacked["targets"][k:k + 1])}
    want_loss, want_grad = value_and_grad(params, alone)
    # example k's segment in the packed rows: everything else left out of the loss
    row, segment = (0, k + 1) if k < 3 else (1, 1)
    mine = np.zeros(packed["targets"].shape, bool)
    mine[row] = np.asarray(packed["segment_ids"][row]) == segment
    batch = dict(packed, targets=jnp.where(mine, packed["targets"], -1))
    loss, grad = value_and_grad(params, batch)
    assert float(loss) == pytest.approx(float(want_loss), abs=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grad, want_grad)


def test_bad_lines_are_named(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "a", "completion": "b"}\n{"text": "c"}\n')
  with pytest.raises(data.DataError, match="bad.jsonl:2"):
    data.load_source(f"sft:{path}")
  with pytest.raises(data.DataFileNotFoundError):
    data.load_source(f"sft:{tmp_path / 'missing.jsonl'}")


def make_tokenizer(directory, words) -> None:
  """A word-level tokenizer.json of ``["[UNK]", "</s>", *words]`` (eos ``</s>``) in ``directory``."""
  import tokenizers

  vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["</s>"])  # one token in text, as chat templates write it
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def test_hf_tokenizer_encodes_with_its_eos(tmp_path):
  make_tokenizer(tmp_path, ["hello", "world"])
  t = hf_tokenizer.load(str(tmp_path))
  assert t.eod == 1 and t.vocab_size == 4
  assert list(t.encode("hello world other", append_eod=True)) == [2, 3, 0, 1]


def test_packed_batch_on_a_pipeline_mesh_matches_one_device(tmp_path):
  """Segment ids and positions travel with their micro-batch through the pipeline."""
  import dion_jax

  source = data.load_source(f"sft:{_write(tmp_path, EXAMPLES * 4)}")
  rows = source.rows(CFG.seq_len)
  batch = {k: jnp.asarray(v[:4]) for k, v in rows.items()}
  assert len(rows["inputs"]) >= 4 and int(batch["segment_ids"].max()) > 1
  graphdef, params = models.init(CFG, seed=0)
  want = jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch)))(params)
  mesh = dion_jax.make_mesh("fs=2,pp=2", jax.devices()[:4])
  par = models.Parallelism(mesh, microbatches=2)
  with jax.set_mesh(mesh):
    _, mesh_params = models.init(CFG, par, seed=0)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch, par)))(mesh_params)
  assert float(loss) == pytest.approx(float(want[0]), abs=1e-5)
  grads = dict(grads, blocks=models.to_layers(grads["blocks"], 2))
  want_grads = dict(want[1], blocks=models.to_layers(want[1]["blocks"], 1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), grads, want_grads)
