"""One validation loss: the trainer's on ``sft:`` data equals ``train.eval``'s on the same
file and checkpoint, and both equal a float64 NumPy loss over the file's learned targets;
the fine-tuning log counts examples and epochs."""
import contextlib
import io
import json
import shutil

import jax
import numpy as np
import pytest

import data
from tests.test_models_gpt import np_token_losses
from tests.test_train_gpt import compile_cache  # noqa: F401  (the resumed run reuses the compiled step)
from train import eval as eval_lib
from train import gpt
from train.run import restore as restore_lib

SEQ, BATCH = 32, 4
# Training rows of 32 inputs: two 17-token examples (16 bytes + EOD) share a row, a 33-token
# one (32 bytes + EOD) fills one; 4 rows of each kind, 12 examples in 8 rows, 2 steps an epoch.
SHORT = [("q%02d:" % i, "short answer" if i % 2 else "other answer") for i in range(8)]
LONG = [("long %02d:" % i, "a completion of 24 bytes") for i in range(4)]
TRAIN = [ex for i in range(4) for ex in (SHORT[2 * i], SHORT[2 * i + 1], LONG[i])]


def _valid_examples():
  """Examples of 3..28 tokens: the learned counts of rows differ, and the packed rows do not
  fill whole batches."""
  rng = np.random.default_rng(0)
  letters = np.array(list("abcdefghij "))
  return [("".join(rng.choice(letters, rng.integers(1, 12))), "".join(rng.choice(letters, rng.integers(1, 15))))
          for _ in range(21)]


def _write(path, examples):
  path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in examples))
  return path


@pytest.fixture(scope="module")
def run(compile_cache, tmp_path_factory):  # noqa: F811
  root = tmp_path_factory.mktemp("sft_eval")
  assert [len(p) + len(c) + 1 for p, c in TRAIN[:3]] == [17, 17, 33]
  train_file, valid_file = _write(root / "train.jsonl", TRAIN), _write(root / "valid.jsonl", _valid_examples())
  args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-len", str(SEQ),
          "--global-batch-size", str(BATCH), "--log-interval", "1", "--eval-every", "0", "--mesh", "fs=2",
          "--lr", "0.01", "--data", f"sft:{train_file}", "--valid-data", f"sft:{valid_file}"]
  run_dir, out = root / "run", io.StringIO()
  with contextlib.redirect_stdout(out):
    code = gpt.main([*args, "--steps", "5", "--run-dir", str(run_dir)])
  assert code == 0, out.getvalue()
  with open(run_dir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  return run_dir, valid_file, records, out.getvalue(), args


def test_trainer_and_eval_give_the_mean_over_every_learned_target(run, capsys):
  run_dir, valid_file, records, _, _ = run
  rows = data.load_source(f"sft:{valid_file}").rows(SEQ)
  assert len(rows["inputs"]) % BATCH and len(rows["inputs"]) > BATCH  # a padded last batch
  trainer = [r["val_loss"] for r in records if "val_loss" in r]
  assert len(trainer) == 1 and records[-1]["step"] == 5
  # train.eval on one device, 8 rows a batch: another batching of the same rows
  assert eval_lib.main([str(run_dir), "--data", f"sft:{valid_file}", "--seq-len", str(SEQ)]) == 0
  printed = capsys.readouterr().out.splitlines()[-1]
  assert printed.startswith("validation lm loss: ")
  evaluated = float(printed.split()[3])

  # The reference: each example alone (no packing, no padding), float64, its learned targets.
  restored = restore_lib.restore(str(run_dir))
  params = dict(restored.params, blocks=jax.tree.map(lambda a: a[None], restored.params["blocks"]))  # one stage
  total, count = 0.0, 0
  for prompt, completion in _valid_examples():
    tokens = np.array(list((prompt + completion).encode()) + [data.EOD])
    losses = np_token_losses(params, restored.cfg, tokens[None, :-1], tokens[None, 1:])[0]
    learned = np.arange(1, len(tokens)) >= len(prompt.encode())
    total, count = total + losses[learned].sum(), count + learned.sum()
  want = total / count
  # Achieved relative to the reference: trainer 2e-8, train.eval 4e-8 (its 7 printed digits).
  # Broken on purpose: a mean of per-batch means is 5e-4 off, padding with the first rows again
  # 3.0e-3, dropping the last partial batch 2.8e-3.
  np.testing.assert_allclose(trainer[0], want, rtol=3e-7)
  np.testing.assert_allclose(evaluated, want, rtol=3e-7)
  assert f"| targets: {count} |" in printed


def test_sft_log_shows_examples_and_epochs(run, tmp_path):
  run_dir, _, records, stdout, args = run
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
  # 8 rows, 4 a step: an epoch is 2 steps, and every epoch serves each of the 12 examples once.
  assert [r["epoch"] for r in steps] == [0.5, 1.0, 1.5, 2.0, 2.5]
  examples = [r["examples"] for r in steps]
  assert examples[1] == len(TRAIN) and examples[3] == 2 * len(TRAIN)
  # a step serves 4 rows of one or two examples each
  assert all(BATCH <= b - a <= 2 * BATCH for a, b in zip([0, *examples], examples))
  lines = [line for line in stdout.splitlines() if line.startswith("iteration")]
  assert f"consumed examples: {examples[3]} | epoch: 2.000 |" in lines[3]
  # a resumed run goes on counting from the checkpoint's (step 5): step 6 ends the third epoch
  resumed = tmp_path / "run"
  shutil.copytree(run_dir, resumed)
  with contextlib.redirect_stdout(io.StringIO()):
    assert gpt.main([*args, "--run-dir", str(resumed), "--resume", "--steps", "6", "--lr-decay-steps", "6",
                     "--eval-tokens", "0"]) == 0
  with open(resumed / "metrics.jsonl") as f:
    last = json.loads(f.readlines()[-1])
  assert (last["step"], last["epoch"], last["examples"]) == (6, 3.0, 3 * len(TRAIN))
