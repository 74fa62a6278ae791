"""Hugging Face checkpoints through the command lines: fine-tune with ``train.gpt --init-from
hf:DIR``, ``train.export`` back (transformers loads it with our logits; import of the export
is bit-exact), ``train.eval`` on both; bad input is one line and exit 2."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import models
from data import hf_tokenizer
from tests import xla_env
from tests.test_data_sft import make_tokenizer
from tests.test_models_hf import hf_logits, make_hf_model, np_loss
from tests.test_train_gpt import free_port
from train import eval as eval_lib
from train import export as export_lib
from train import gpt, sample
from train.run import restore as restore_lib
from train.store import hf as hf_io

transformers = pytest.importorskip("transformers", reason="the Hugging Face reference tests need the dev extra: pip install -e \".[dev]\"")

SEQ = 16
# A vocabulary above the byte tokenizer's 257 so that train.eval can read the embedded corpus.
VOCAB = 384
WORDS = [f"w{i}" for i in range(40)]


def first_windows(spec: str, count: int, seq_len: int) -> np.ndarray:
  """The first ``count`` windows [count, seq_len + 1] of ``spec``'s token streams, in order:
  window i of a stream is its tokens [i·T, i·T + T]; none crosses into the next stream."""
  out = []
  for stream in data.load_source(spec, progress=False).streams:
    stream = np.asarray(stream)
    out += [stream[i * seq_len:i * seq_len + seq_len + 1] for i in range((len(stream) - 1) // seq_len)]
    if len(out) >= count:
      return np.stack(out[:count])
  raise AssertionError(f"{spec} has fewer than {count} windows")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny random Qwen3 (tied embeddings, explicit head_dim) fine-tuned 2 steps on fs=2,tp=2
  on packed prompt/completion lines and conversations (its chat_template.jinja) with its own
  (word-level) tokenizer."""
  root = tmp_path_factory.mktemp("hf")
  source = root / "qwen3"
  make_hf_model("qwen3", source, vocab_size=VOCAB)
  make_tokenizer(source, WORDS)
  (source / "chat_template.jinja").write_text(
      "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
      "{% if add_generation_prompt %}assistant {% endif %}")
  sft = root / "sft.jsonl"
  rng = np.random.default_rng(0)

  def words(n):
    return " ".join(rng.choice(WORDS, n))

  sft.write_text("".join(json.dumps({"prompt": words(5), "completion": words(3)} if k % 2 else
                                    {"messages": [{"role": "user", "content": words(3)},
                                                  {"role": "assistant", "content": words(2)}]}) + "\n"
                         for k in range(16)))
  run = root / "run"
  flags = ["--init-from", f"hf:{source}", "--data", f"sft:{sft}", "--steps", "2",
           "--global-batch-size", "4", "--seq-len", str(SEQ), "--run-dir", str(run),
           "--eval-every", "0", "--eval-tokens", "0", "--mesh", "fs=2,tp=2", "--save-every", "2",
           "--log-interval", "1", "--lr", "0.01"]
  assert gpt.main(flags) == 0
  return source, run


def _records(run):
  with open(run / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if '"loss"' in line]


def test_fine_tune_export_loads_in_transformers(trained, tmp_path):
  source, run = trained
  assert [r["step"] for r in _records(run)] == [1, 2]
  out = tmp_path / "export"
  assert export_lib.main([str(run), "--output", str(out)]) == 0
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja"} <= set(os.listdir(out))
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  restored = restore_lib.restore(str(run))
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ)).astype(np.int32)
  ours = np.asarray(sample.logits(restored.graphdef, restored.params, jnp.asarray(tokens)))[..., :VOCAB]
  np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=1e-4, rtol=0)
  # the model trained: its weights moved away from the source's
  _, initial = hf_io.load(str(source), restored.cfg, models.Parallelism())
  assert not np.allclose(np.asarray(initial["embed"]["embedding"]), np.asarray(restored.params["embed"]["embedding"]))


def test_a_model_trained_from_scratch_with_swiglu_exports(tmp_path, capsys):
  """``--mlp swiglu --qk-norm rms_scale``: a Qwen3 of train.gpt's own initialization (byte
  tokens, its vocabulary padding masked as an import's is), trained on tp=2 with ``--fp8``;
  train.export writes its float32 weights, transformers loads them with the logits of our
  model without FP8, and train.eval gives the run's own validation loss on the run (in FP8,
  as it trained) and, within FP8's rounding, on the export (which has no padding rows:
  unmasked, the trained padding is 1e-2 off). AdamW: its step compiles faster than Dion's."""
  run, out = tmp_path / "run", tmp_path / "export"
  assert gpt.main(["--mlp", "swiglu", "--qk-norm", "rms_scale", "--num-layers", "2", "--hidden-size", "32",
                   "--num-attention-heads", "2", "--seq-len", str(SEQ), "--global-batch-size", "4", "--steps", "2",
                   "--eval-tokens", "64", "--mesh", "tp=2", "--optimizer", "adamw", "--fp8", "--run-dir", str(run)]) == 0
  assert export_lib.main([str(run), "--output", str(out)]) == 0
  assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  restored = restore_lib.restore(str(run))
  assert restored.cfg.fp8 == "current"
  tokens = np.random.default_rng(0).integers(0, data.VOCAB_SIZE, (2, SEQ)).astype(np.int32)
  plain = models.abstract(dataclasses.replace(restored.cfg, fp8="none"))[0]
  ours = np.asarray(sample.logits(plain, restored.params, jnp.asarray(tokens)))[..., :data.VOCAB_SIZE]
  np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=1e-4, rtol=0)
  with open(run / "metrics.jsonl") as f:
    trained = [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r][-1]
  capsys.readouterr()
  for model_arg, rel in ((str(run), 1e-6), (f"hf:{out}", 1e-2)):
    assert eval_lib.main([model_arg, "--data", "stdlib:val", "--seq-len", str(SEQ), "--eval-tokens", "64"]) == 0
    assert float(capsys.readouterr().out.split()[3]) == pytest.approx(trained, rel=rel)


def test_import_export_import_is_bit_exact(trained, tmp_path, monkeypatch):
  """Also: the export streams, reading each checkpoint leaf once and holding one at a time."""
  _, run = trained
  restored = restore_lib.restore(str(run))
  out = tmp_path / "sharded"
  reads, read = [], export_lib._Leaves.read

  def counted(self, path):
    if path != self._path:
      reads.append(tuple(k.key for k in path))
    return read(self, path)

  monkeypatch.setattr(export_lib._Leaves, "read", counted)
  # a shard limit below the model's size: several files and an index
  assert export_lib.main([str(run), "--output", str(out), "--max-shard-bytes", "100000"]) == 0
  assert sorted(reads) == sorted(tuple(k.key for k in path) for path, _ in
                                 jax.tree_util.tree_leaves_with_path(restored.params))
  assert (out / "model.safetensors.index.json").exists()
  assert all(os.stat(out / n).st_mode & 0o044 == 0o044 for n in os.listdir(out))  # not private
  cfg = hf_io.model_config(str(out), seq_len=SEQ)
  _, params = hf_io.load(str(out), cfg, models.Parallelism())
  params = dict(params, blocks=models.to_layers(params["blocks"], 1))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored.params)


def test_eval_of_run_and_export_agree_with_transformers(trained, tmp_path, capsys):
  _, run = trained
  out = tmp_path / "export"
  assert export_lib.main([str(run), "--output", str(out)]) == 0
  capsys.readouterr()
  flags = ["--data", "stdlib:val", "--tokens", "100", "--seq-len", str(SEQ)]
  losses = []
  # one device, then sharded: the run's checkpoint restaged into a pipeline, the export
  # read slice by slice over fs and cp
  for model, mesh in [(str(run), []), (f"hf:{out}", []), (str(run), ["--mesh", "pp=2,tp=2"]),
                      (f"hf:{out}", ["--mesh", "fs=2,cp=2"])]:
    assert eval_lib.main([model, *flags, *mesh]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("validation lm loss: ") and "PPL" in line
    losses.append(float(line.split()[3]))
  assert losses[1:] == pytest.approx([losses[0]] * 3, rel=1e-6)
  # the definition, recomputed from transformers: the first 100 // T windows i·T .. i·T + T
  w = first_windows("stdlib:val", 100 // SEQ, SEQ)
  assert w.shape == (6, SEQ + 1)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  assert losses[1] == pytest.approx(np_loss(hf_logits(model, w[:, :-1]), w[:, 1:]), rel=1e-5)


def test_eval_of_fine_tuning_data_is_transformers_loss_on_the_learned_targets(trained, tmp_path, capsys):
  """train.eval on the run's own sft: file (prompt/completion lines and conversations) on
  fs=2: the mean over the learned targets, recomputed from transformers' logits example
  by example."""
  source, run = trained
  sft_file = run.parent / "sft.jsonl"
  assert eval_lib.main([str(run), "--data", f"sft:{sft_file}", "--seq-len", str(SEQ), "--mesh", "fs=2"]) == 0
  words = capsys.readouterr().out.split()
  out = tmp_path / "export"
  assert export_lib.main([str(run), "--output", str(out)]) == 0
  model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  examples = data.load_source(f"sft:{sft_file}", tokenizer=hf_tokenizer.load(str(source))).examples
  losses = []
  for tokens, learn in examples:
    assert len(tokens) <= SEQ + 1  # no example is cut
    logits = hf_logits(model, tokens[None, :-1])[0]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - logits[np.arange(len(tokens) - 1), tokens[1:]]
    losses.extend(nll[learn[1:]])
  assert int(words[words.index("targets:") + 1]) == len(losses)
  assert float(words[3]) == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.slow
def test_eval_on_two_processes_matches_one(trained, capsys):
  """Two processes x 2 CPU devices (gloo) evaluate the run on fs=2,tp=2, each reading its
  own slices of the checkpoint; process 0 prints one device's loss."""
  _, run = trained
  flags = ["--data", "stdlib:val", "--tokens", "100", "--seq-len", str(SEQ)]
  assert eval_lib.main([str(run), *flags]) == 0
  want = capsys.readouterr().out
  env = xla_env.subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "train.eval", str(run), *flags, "--mesh", "fs=2,tp=2",
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                             "--process-id", str(i)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
  lines = [[line for line in out.splitlines() if line.startswith("validation")] for out, _ in outs]
  assert len(lines[0]) == 1 and not lines[1]  # gloo writes its own lines to stdout
  assert float(lines[0][0].split()[3]) == pytest.approx(float(want.split()[3]), rel=1e-6)


def test_bad_input_one_line_exit_2(trained, tmp_path, capsys):
  source, run = trained
  bad = tmp_path / "gpt2"
  bad.mkdir()
  config = json.loads((source / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
  dense_moe = tmp_path / "dense_moe"  # a Qwen3-MoE whose layer 1 is dense (mlp_only_layers)
  dense_moe.mkdir()
  (dense_moe / "config.json").write_text(json.dumps({
      **config, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "mlp_only_layers": [1]}))
  cases = [
      (gpt.main, ["--init-from", f"hf:{bad}", "--run-dir", str(tmp_path / "r1")], "GPT2LMHeadModel"),
      (gpt.main, ["--init-from", f"hf:{source}", "--num-layers", "3", "--run-dir", str(tmp_path / "r2")],
       "--num-layers"),
      (eval_lib.main, [f"hf:{tmp_path / 'missing'}", "--data", "stdlib:val"], "config.json"),
      (eval_lib.main, [f"hf:{dense_moe}", "--data", "stdlib:val"], "mlp_only_layers=[1]"),
      (eval_lib.main, [f"hf:{source}", "--data", "stdlib:val", "--seq-len", "65"],
       "--seq-len 65 exceeds the 64 positions"),  # as train.gpt's; was evaluated past them
      (eval_lib.main, [str(run), "--data", "stdlib:val", "--mesh", "fs=4", "--batch-size", "6"],
       "--batch-size 6 does not split over the 4 data-parallel ranks"),
      (eval_lib.main, [str(run), "--data", "stdlib:val", "--mesh", "cp=2", "--seq-len", "6"], "--seq-len"),
      (eval_lib.main, [str(run), "--data", "stdlib:val", "--mesh", "tp=16"], "needs 16 devices but 8"),
      (eval_lib.main, [str(run), "--data", "stdlib:val", "--coordinator", "127.0.0.1:1"],
       "multi-host runs need all of --coordinator"),
      (export_lib.main, [str(run), "--output", str(source)], "already exists"),
  ]
  for main, argv, message in cases:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
  # mismatched shapes: config.json says more layers than the weights hold
  wrong = tmp_path / "wrong"
  wrong.mkdir()
  (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
  os.symlink(source / "model.safetensors", wrong / "model.safetensors")
  assert eval_lib.main([f"hf:{wrong}", "--data", "stdlib:val"]) == 2
  err = capsys.readouterr().err.strip()
  assert "mlp.gate_proj.weight has shape" in err and "\n" not in err
  assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
  # By default the model's own positions, as train.gpt's --seq-len (was 1024 past its 64).
  assert eval_lib.main([f"hf:{source}", "--data", "stdlib:val", "--eval-tokens", "64"]) == 0
  assert capsys.readouterr().out.strip().endswith("targets: 64 | rows: 1 x 64 tokens")


@pytest.mark.parametrize("optimizer", ["dion2", "normuon"])
def test_orthogonal_family_trains_the_new_matrices(trained, tmp_path, optimizer):
  """Default labels route gate/up/down and GQA's narrower key/value to the matrix optimizer
  (Dion itself trains the fixture's run); one step on fs=2,tp=2 changes every kernel."""
  source, _ = trained
  run = tmp_path / optimizer
  assert gpt.main(["--init-from", f"hf:{source}", "--optimizer", optimizer, "--steps", "1",
                   "--global-batch-size", "4", "--seq-len", str(SEQ), "--run-dir", str(run),
                   "--eval-tokens", "0", "--mesh", "fs=2,tp=2"]) == 0
  restored = restore_lib.restore(str(run))
  _, initial = hf_io.load(str(source), restored.cfg, models.Parallelism())
  initial = dict(initial, blocks=models.to_layers(initial["blocks"], 1))
  for name in ("query", "key", "value", "out"):
    assert not np.array_equal(restored.params["blocks"]["attn"][name]["kernel"], initial["blocks"]["attn"][name]["kernel"])
  for name in ("gate", "up", "down"):
    assert not np.array_equal(restored.params["blocks"]["mlp"][name]["kernel"], initial["blocks"]["mlp"][name]["kernel"])


def test_sample_writes_with_the_run_tokenizer(trained, capsys):
  _, run = trained
  assert sample.main([str(run), "--prompt", "w1 w2", "--max-new-tokens", "3"]) == 0
  words = capsys.readouterr().out.split()
  assert words[:2] == ["w1", "w2"] and len(words) == 5


def test_sample_chat_prints_the_reply_up_to_its_eos(trained, capsys, monkeypatch):
  """--chat: the prompt goes through the chat template with the generation prompt, and the
  reply stops at the first eos."""
  _, run = trained
  prompts, eos_ids = [], []

  def reply(model, prompt_P, max_new_tokens, *args, eos_id=None):
    prompts.append(list(prompt_P))
    eos_ids.append(eos_id)
    return iter([np.asarray([4], np.int32), np.asarray([5, 1, 6], np.int32)])  # w2, w3 </s> w4

  monkeypatch.setattr(sample, "continuation", reply)
  assert sample.main([str(run), "--prompt", "w1 w2", "--chat"]) == 0
  assert capsys.readouterr().out.split() == ["w2", "w3"]
  assert prompts == [[0, 3, 4, 1, 0]]  # "user w1 w2 </s> assistant ", roles unknown to the words
  assert eos_ids == [1]  # the sampler stops each sequence at </s>


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_every_2"])
def test_qwen3_moe_export_is_what_transformers_saved(tmp_path, arch):
  """Import then export, with no training between: the per-expert tensors save_pretrained
  wrote, under the same names, and from_pretrained loads the source model's exact weights
  (with dense layers between the mixtures too)."""
  source = tmp_path / arch
  model = make_hf_model(arch, source)
  cfg = hf_io.model_config(str(source), seq_len=SEQ)
  _, params = hf_io.load(str(source), cfg, models.Parallelism())
  params = jax.tree.map(np.asarray, dict(params, blocks=models.to_layers(params["blocks"], 1)))
  out = tmp_path / "export"
  hf_io.save(str(out), cfg, params, hf_io.read_config(str(source)), max_shard_bytes=100000)
  assert (out / "model.safetensors.index.json").exists()
  assert set(hf_io._weight_files(str(out))) == set(hf_io._weight_files(str(source)))
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert type(loaded) is type(model)
  want, got = model.state_dict(), loaded.state_dict()
  assert set(got) == set(want)
  for name in want:
    assert got[name].equal(want[name]), name


def test_qwen3_moe_fine_tune_export(tmp_path, capsys):
  """One step of a tiny Qwen3-MoE with its experts split over ep=2 (AdamW, whose step
  compiles faster than Dion's); train.export of the run loads in transformers with our
  logits, importing it again is bit-exact, and train.eval on ep=2 gives transformers' loss
  (the language-model loss, without the router's)."""
  source = tmp_path / "qwen3_moe"
  make_hf_model("qwen3_moe", source, vocab_size=VOCAB)
  run = tmp_path / "run"
  assert gpt.main(["--init-from", f"hf:{source}", "--optimizer", "adamw", "--steps", "1",
                   "--global-batch-size", "4", "--seq-len", str(SEQ), "--run-dir", str(run),
                   "--eval-tokens", "0", "--mesh", "ep=2", "--lr", "0.01"]) == 0
  restored = restore_lib.restore(str(run))
  _, initial = hf_io.load(str(source), restored.cfg, models.Parallelism())
  # the experts trained
  initial_gate = models.to_layers(initial["blocks"], 1)["mlp"]["experts"]["gate"]
  assert not np.allclose(initial_gate, restored.params["blocks"]["mlp"]["experts"]["gate"])
  out = tmp_path / "export"
  assert export_lib.main([str(run), "--output", str(out)]) == 0
  model, info = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager",
                                                                  output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ)).astype(np.int32)
  ours = np.asarray(sample.logits(restored.graphdef, restored.params, jnp.asarray(tokens)))[..., :VOCAB]
  np.testing.assert_allclose(ours, hf_logits(model.eval(), tokens), atol=1e-4, rtol=0)
  cfg = hf_io.model_config(str(out), seq_len=SEQ)
  assert cfg == restored.cfg
  _, params = hf_io.load(str(out), cfg, models.Parallelism())
  params = dict(params, blocks=models.to_layers(params["blocks"], 1))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored.params)
  capsys.readouterr()
  assert eval_lib.main([str(run), "--data", "stdlib:val", "--tokens", "100", "--mesh", "ep=2"]) == 0
  w = first_windows("stdlib:val", 100 // SEQ, SEQ)
  loss = float(capsys.readouterr().out.split()[3])
  assert loss == pytest.approx(np_loss(hf_logits(model, w[:, :-1]), w[:, 1:]), rel=1e-5)
