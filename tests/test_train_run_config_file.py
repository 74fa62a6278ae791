"""``train.gpt --config FILE`` and ``--print-config`` (``train/run/config_file.py``): a YAML file
written by hand reproduces a flags-only run bit for bit (the same program on the same
inputs), the printed config reads back to the same config, a run's config.json serves as
a file, flags override the file, and bad keys and values are one line naming the key."""
import json

import jax
import numpy as np
import pytest

from tests.test_train_gpt import SMALL, records, saved_state
from train import gpt
from train.run import config as config_lib

# SMALL and the run's own flags, as a person would write them in a file: both key
# spellings, YAML's ints, floats, booleans, lists and strings.
YAML = """\
num-layers: 2
hidden_size: 32
num_attention_heads: 2
seq_len: 16
global_batch_size: 8
eval_tokens: 128
log_interval: 1
dion_rank_fraction: 0.25
clip-grad: 0.5
steps: 3
eval_every: 2
mesh: fs=2
lr: 1.0e-2
pack: true
data: [stdlib]
"""
FLAGS = [*SMALL, "--steps", "3", "--eval-every", "2", "--mesh", "fs=2", "--lr", "0.01"]
TIMING = ("ms_per_step", "tokens_per_s", "tflops_per_device", "mfu")


@pytest.fixture(scope="module")
def flags_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("config") / "flags"
  assert gpt.main([*FLAGS, "--run-dir", str(run_dir)]) == 0
  return run_dir


def test_a_yaml_config_reproduces_the_flags_only_run_bit_for_bit(flags_run, tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text(YAML + f"run_dir: {tmp_path / 'ignored'}\n")  # the command line's --run-dir wins
  run_dir = tmp_path / "from_yaml"
  assert gpt.main(["--config", str(path), "--run-dir", str(run_dir)]) == 0
  assert not (tmp_path / "ignored").exists()
  untimed = [[{k: v for k, v in r.items() if k not in TIMING} for r in records(d)] for d in (flags_run, run_dir)]
  assert untimed[0] == untimed[1] and len(untimed[0]) == 5  # 3 intervals, 2 validations
  a, b = saved_state(flags_run), saved_state(run_dir)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  configs = [json.loads((d / "config.json").read_text()) for d in (flags_run, run_dir)]
  for c in configs:
    c["train"].pop("run_dir")
  assert configs[0] == configs[1]


def test_print_config_round_trips(tmp_path, capsys):
  assert gpt.main([*FLAGS, "--data", "0.7", "stdlib", "0.3", "stdlib", "--tensorboard", "--remat",
                   "--print-config"]) == 0
  printed = capsys.readouterr().out
  path = tmp_path / "printed.yaml"
  path.write_text(printed)
  assert gpt.main(["--config", str(path), "--print-config"]) == 0
  assert capsys.readouterr().out == printed
  expected = config_lib.parse([*FLAGS, "--data", "0.7", "stdlib", "0.3", "stdlib", "--tensorboard", "--remat"])
  assert config_lib.parse(["--config", str(path)]) == expected
  assert expected.data == ("0.7", "stdlib", "0.3", "stdlib") and expected.tensorboard == "" and expected.lr == 0.01


def test_a_runs_config_json_is_a_config_file(flags_run, tmp_path):
  """Its train record, less what describes one invocation (the run directory)."""
  again = config_lib.parse(["--config", str(flags_run / "config.json"), "--run-dir", str(tmp_path / "again")])
  assert again == config_lib.parse([*FLAGS, "--run-dir", str(tmp_path / "again")])
  assert config_lib.parse(["--config", str(flags_run / "config.json")]).run_dir is None


def test_command_line_flags_override_the_file(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text(YAML)
  cfg = config_lib.parse(["--config", str(path), "--lr", "0.5", "--mesh", "fs=1", "--no-pack"])
  assert (cfg.lr, cfg.mesh, cfg.pack, cfg.steps, cfg.clip_grad) == (0.5, "fs=1", False, 3, 0.5)


@pytest.mark.parametrize("text, message", [
    ("steps: 3\nlearning_rate: 0.1\n", "unknown key 'learning_rate'"),
    ("lr: fast\n", "lr: invalid float value: 'fast'"),
    ("steps: 2.5\n", "steps: invalid int value: '2.5'"),
    ("optimizer: sgd\n", "optimizer: invalid choice: 'sgd'"),
    ("remat: 1\n", "recompute policy (--remat) '1': unknown; choose one of none, full"),
    ("steps: true\n", "steps: expected one value of --steps, got True"),
    ("mesh: [fs=2]\n", "mesh: expected one value of --mesh"),
    ("steps: null\n", "steps: null is no value of --steps"),
    ("steps: 0\n", "--steps must be positive, got 0"),
    ("- steps\n", "expected a mapping of flags to values"),
    ("steps: [\n", "is not readable YAML"),
])
def test_bad_keys_and_values_are_one_line(text, message, tmp_path, capsys):
  path = tmp_path / "run.yaml"
  path.write_text(text)
  assert gpt.main(["--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
  assert not (tmp_path / "run").exists()


def test_a_missing_file_is_one_line(tmp_path, capsys):
  assert gpt.main(["--config", str(tmp_path / "absent.yaml")]) == 2
  assert capsys.readouterr().err == f"error: --config {tmp_path / 'absent.yaml'} does not exist; pass a YAML or JSON file of flags\n"
