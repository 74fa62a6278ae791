"""python -m train.sample: restore, logits, greedy and temperature decoding, bad input.

The module's run trains 4 steps on fs=2,tp=2 (of conftest's 8 CPU devices) and the
sampler restores it on one device. A float64 NumPy forward of the GPT, written here from
the model's description, checks the sampler's logits, the trainer's own validation loss
(so the restore too) and every greedy token.
"""
import json
import os

import jax
import numpy as np
import pytest

import data
import models
from data import hf_tokenizer
from tests.test_models_gpt import PUBLISHED_NORM_EPS, PUBLISHED_ROPE_BASE
from train import eval as eval_lib
from train import gpt, sample
from train.run import restore as restore_lib

SEQ_LEN, BATCH, EVAL_TOKENS = 16, 4, 128
RUN = ["--steps", "4", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--seq-len", str(SEQ_LEN), "--global-batch-size", str(BATCH), "--save-every", "2",
       "--eval-every", "2", "--eval-tokens", str(EVAL_TOKENS), "--mesh", "fs=2,tp=2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("sample") / "run")
  assert gpt.main([*RUN, "--run-dir", path]) == 0
  return path


@pytest.fixture(scope="module")
def restored(run_dir):
  return restore_lib.restore(run_dir)


def _rms(x, scale=1.0):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + PUBLISHED_NORM_EPS) * scale


def _rotary(x_BxTxNxH, base):
  half = x_BxTxNxH.shape[-1] // 2
  angles_TxH2 = np.arange(x_BxTxNxH.shape[1])[:, None] / base ** (np.arange(half) / half)
  cos, sin = np.cos(angles_TxH2)[:, None], np.sin(angles_TxH2)[:, None]
  x1, x2 = x_BxTxNxH[..., :half], x_BxTxNxH[..., half:]
  return np.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)


def reference_logits(params, cfg, tokens_BxT):
  """The GPT's logits [B, T, V] in float64 NumPy, from the pure-dict parameters (layer order)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  blocks = p["blocks"]
  B, T = tokens_BxT.shape
  N, H = cfg.num_heads, cfg.head_dim
  causal_TxT = np.tril(np.ones((T, T), bool))
  x = p["embed"]["embedding"][tokens_BxT]
  for i in range(cfg.num_layers):
    w = lambda *names: blocks[names[0]][names[1]]["kernel"][i]  # noqa: E731
    h = _rms(x, blocks["attn_norm"]["scale"][i])
    q = _rms(_rotary((h @ w("attn", "query")).reshape(B, T, N, H), PUBLISHED_ROPE_BASE))
    k = _rms(_rotary((h @ w("attn", "key")).reshape(B, T, N, H), PUBLISHED_ROPE_BASE))
    v = (h @ w("attn", "value")).reshape(B, T, N, H)
    s_BxNxTxT = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    s_BxNxTxT = np.where(causal_TxT, s_BxNxTxT, -np.inf)
    a_BxNxTxT = np.exp(s_BxNxTxT - s_BxNxTxT.max(-1, keepdims=True))
    a_BxNxTxT /= a_BxNxTxT.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", a_BxNxTxT, v).reshape(B, T, N * H)
    x = x + o @ w("attn", "out")
    h = _rms(x, blocks["mlp_norm"]["scale"][i])
    x = x + np.square(np.maximum(h @ w("mlp", "up"), 0)) @ w("mlp", "down")
  return _rms(x, p["final_norm"]["scale"]) @ p["lm_head"]["kernel"]


def test_restored_model_gives_the_trainers_validation_loss(run_dir, restored):
  """The restore (saved on fs=2,tp=2, read on one device) and the reference forward
  reproduce the trainer's last validation loss."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [r for r in map(json.loads, f) if "val_loss" in r]
  assert restored.step == 4 and records[-1]["step"] == 4
  loader = data.make_loader(data.load_source("stdlib:val", progress=False), seq_len=SEQ_LEN,
                            global_batch_size=BATCH, seed=0, shuffle=False)
  losses = []
  for _ in range(EVAL_TOKENS // (BATCH * SEQ_LEN)):
    batch = next(loader)
    logits_BxTxV = reference_logits(restored.params, restored.cfg, batch["inputs"])
    m = logits_BxTxV.max(-1, keepdims=True)
    logz_BxT = (m + np.log(np.exp(logits_BxTxV - m).sum(-1, keepdims=True)))[..., 0]
    target_BxT = np.take_along_axis(logits_BxTxV, batch["targets"][..., None], -1)[..., 0]
    losses.append(np.mean(logz_BxT - target_BxT))
  np.testing.assert_allclose(np.mean(losses), records[-1]["val_loss"], rtol=1e-5)


def test_eval_of_the_run_prints_its_validation_loss(run_dir, capsys):
  """``train.eval RUN_DIR`` with no other flag repeats the run's last validation loss: the
  same data, --eval-tokens (EVAL_TOKENS targets) and --seq-len, read on one device where the
  trainer read it on fs=2,tp=2 (another compiled program: within 1e-6, its 7 printed digits)."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    trainer = [r for r in map(json.loads, f) if "val_loss" in r][-1]["val_loss"]
  capsys.readouterr()
  assert eval_lib.main([run_dir]) == 0
  out, err = capsys.readouterr()
  line = out.strip().splitlines()[-1]
  assert line.startswith("validation lm loss: ") and f"| targets: {EVAL_TOKENS} |" in line
  # the wait (compile, passes) announced on stderr, its rows those of the result line
  rows = line.split("| rows: ")[1].split(" x ")
  assert err == (f"evaluating {rows[0]} rows of {rows[1].split()[0]} tokens, 8 a pass"
                 " (compiling the evaluation step first)\n")
  assert float(line.split()[3]) == pytest.approx(trainer, rel=1e-6)


def test_logits_match_the_reference(restored):
  tokens_1xT = data.encode("def f(x):\n  return")[None, :SEQ_LEN].astype(np.int32)
  got = np.asarray(sample.logits(restored.graphdef, restored.params, tokens_1xT))
  np.testing.assert_allclose(got, reference_logits(restored.params, restored.cfg, tokens_1xT),
                             atol=1e-4, rtol=1e-4)


def test_greedy_takes_the_argmax_of_the_whole_context(restored):
  """Each greedy token is the argmax of the reference's logits over the prompt's last
  seq_len tokens and every token written since (the key/value cache keeps them all): 24
  new tokens after 20 run past seq_len 16, so the prompt's crop and positions beyond the
  training length are exercised."""
  prompt_P = data.encode("def f(x):\n  return x")
  new = sample.generate(restored, prompt_P, 24)
  assert new.shape == (24,)
  tokens = list(prompt_P[-SEQ_LEN:]) + list(new)
  logits_TxV = reference_logits(restored.params, restored.cfg, np.asarray(tokens)[None])[0, :, :data.VOCAB_SIZE]
  for n in range(SEQ_LEN, len(tokens)):
    assert logits_TxV[n - 1, tokens[n]] >= logits_TxV[n - 1].max() - 1e-5, n


def test_sampling_is_reproducible_and_top_k_1_is_greedy(restored):
  prompt_P = data.encode("import ")
  first = sample.generate(restored, prompt_P, 20, temperature=1.0, seed=7)
  np.testing.assert_array_equal(first, sample.generate(restored, prompt_P, 20, temperature=1.0, seed=7))
  assert not np.array_equal(first, sample.generate(restored, prompt_P, 20, temperature=1.0, seed=8))
  assert first.max() < data.VOCAB_SIZE  # padded vocabulary rows are never drawn
  np.testing.assert_array_equal(sample.generate(restored, prompt_P, 20, temperature=0.7, top_k=1),
                                sample.generate(restored, prompt_P, 20))


def test_command_prints_prompt_and_greedy_continuation(run_dir, restored, capsys):
  args = [run_dir, "--prompt", "def ", "--max-new-tokens", "12"]
  assert sample.main(args) == 0
  out, err = capsys.readouterr()
  assert err == "writing up to 12 tokens after 1 prompt (compiling the sampler first)\n"  # the wait, said
  prompt_P = data.encode("def ")
  expected = data.decode(np.concatenate([prompt_P, sample.generate(restored, prompt_P, 12)]))
  assert out == expected + "\n"
  assert sample.main(args) == 0
  assert capsys.readouterr().out == out


def test_each_repeated_prompt_is_continued(run_dir, restored, capsys):
  assert sample.main([run_dir, "--prompt", "def ", "--prompt", "import", "--max-new-tokens", "6"]) == 0
  out = capsys.readouterr().out
  want = [data.decode(np.concatenate([p, sample.generate(restored, p, 6)]))
          for p in (data.encode("def "), data.encode("import"))]
  assert out == f"[prompt 1/2]\n{want[0]}\n[prompt 2/2]\n{want[1]}\n"


def test_text_is_printed_as_it_comes_without_half_characters(capsys):
  """"é" is two bytes (two tokens): printed once both have come, never as U+FFFD between."""
  shown = sample._Shown(hf_tokenizer.ByteTokenizer(), data.encode("ab"))
  for token in data.encode("é!"):
    shown.add(np.asarray([token], np.int32))
    printed = capsys.readouterr().out
    assert "\ufffd" not in printed
  shown.end()
  assert shown.printed == "abé!" and capsys.readouterr().out == "\n"


def test_step_flag_restores_that_checkpoint(run_dir, restored):
  earlier = restore_lib.restore(run_dir, step=2)
  assert earlier.step == 2
  assert not np.array_equal(earlier.params["lm_head"]["kernel"], restored.params["lm_head"]["kernel"])


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "does not exist"),
    (["{empty}"], "holds no run (no config.json, metrics.jsonl, checkpoints)"),
    (["{started}"], "has no checkpoints yet"),
    (["{run}", "--step", "3"], "has checkpoints at steps 2, 4"),
    (["{run}", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["{run}", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["{run}", "--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["{run}", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["{run}", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["{run}", "--top-k", "0"], "--top-k must be positive"),
    (["{run}", "--max-new-tokens", "x"], "invalid int value"),
    (["{run}", "--max-new-tokens", "0"], "--max-new-tokens must be positive, got 0"),  # was a traceback
    # was XLA's out-of-memory traceback after the compile
    (["{run}", "--max-new-tokens", str(10**11)], "--max-new-tokens 100,000,000,000 needs a key/value cache of"),
    (["{run}", "--chat"], "--chat needs a chat template: this run reads bytes"),
    (["{run}", "--top-k", "40"], "--top-k 40 applies when sampling, but --temperature is 0 (the default: greedy)"),
    (["{run}", "--top-p", "0.9"], "--top-p 0.9 applies when sampling, but --temperature is 0"),
])
def test_bad_input(run_dir, tmp_path, capsys, args, message):
  for name in ("empty", "started"):
    (tmp_path / name).mkdir()
  (tmp_path / "started" / "config.json").write_text('{"train": {}}')  # a run killed before its first save
  paths = {"missing": str(tmp_path / "nope"), "empty": str(tmp_path / "empty"),
           "started": str(tmp_path / "started"), "run": run_dir}
  assert sample.main([a.format(**paths) for a in args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_restored_parameters_give_the_models_loss(restored):
  """The sampler's logits agree with models.loss (teacher-forced) on the pp=1 layout."""
  tokens_BxT = data.encode("for i in range(10):\n    print(i)\n")[None, :SEQ_LEN + 1].astype(np.int32)
  batch = {"inputs": tokens_BxT[:, :-1], "targets": tokens_BxT[:, 1:]}
  params = dict(restored.params, blocks=models.to_stages(restored.params["blocks"], 1))
  expected = float(models.loss(restored.graphdef, params, batch))
  logits_BxTxV = np.asarray(sample.logits(restored.graphdef, restored.params, batch["inputs"]), np.float64)
  logz_BxT = np.log(np.exp(logits_BxTxV).sum(-1))
  target_BxT = np.take_along_axis(logits_BxTxV, batch["targets"][..., None], -1)[..., 0]
  np.testing.assert_allclose(np.mean(logz_BxT - target_BxT), expected, rtol=1e-5)
