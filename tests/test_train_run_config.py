"""train/run/config.py: values that make no sense are one line naming the valid range; flags the
optimizer ignores are named; --resume takes the saved run's config (config.json, else the
checkpoint's) and keeps its lr schedule and batch size. No JAX: parse and check only."""
import json
import os

import pytest

from train import gpt
from train.run import config as config_lib
from train.store import rundir


@pytest.mark.parametrize("argv, message", [
    (["--min-lr", "1", "--lr", "0.01"], "--min-lr 1 exceeds the peak --lr 0.01; the decay ends at --min-lr,"
                                         " so choose it in [0, 0.01]"),
    (["--min-lr", "0.005", "--optimizer", "lion"], "--min-lr 0.005 exceeds the peak --lr 0.0003"),
    (["--lr", "-1"], "--lr must be positive, got -1.0"),  # not "--min-lr 0 exceeds the peak --lr -1"
    (["--dion-momentum", "2"], "--dion-momentum must be in [0, 1), got 2"),
    (["--dion-momentum", "-0.1"], "--dion-momentum must be in [0, 1), got -0.1"),
    (["--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"],
     "--coordinator 10.0.0.1: expected HOST:PORT with a port in 1..65535"),
    (["--coordinator", "10.0.0.1:99999", "--num-processes", "2", "--process-id", "0"], "expected HOST:PORT"),
    (["--step", "3"], "--step 3 picks the checkpoint to resume from; add --resume"),
    (["--distributed-timeout", "0"], "--distributed-timeout must be positive"),
    (["--loss-chunk", "-1"], "--loss-chunk must be >= 0, got -1"),
    (["--grad-norm-sketch-size", "1000"], "--grad-norm-sketch-size must be a power of two of at least 2, got 1000"),
    (["--grad-norm-sketch-size", "1"], "--grad-norm-sketch-size must be a power of two of at least 2, got 1"),
])
def test_nonsense_values_are_one_line_exit_2(tmp_path, capsys, argv, message):
  assert gpt.main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
  assert not (tmp_path / "run").exists()


def test_flags_the_optimizer_does_not_read():
  adamw = config_lib.parse(["--optimizer", "adamw", "--dion-momentum", "0.5", "--ortho-dtype", "float32"])
  assert adamw.ignored_flags() == ["--dion-momentum", "--ortho-dtype"]
  muon = config_lib.parse(["--optimizer", "muon", "--dion-rank-fraction", "0.5", "--ortho-dtype", "float32"])
  assert muon.ignored_flags() == ["--dion-rank-fraction"]
  assert config_lib.parse(["--dion-rank-fraction", "0.5", "--dion-momentum", "0.9"]).ignored_flags() == []
  assert config_lib.parse(["--optimizer", "lion"]).ignored_flags() == []


def saved_run(tmp_path, **train) -> str:
  run = tmp_path / "run"
  run.mkdir()
  record = {"train": {**config_lib.Config(**train).to_json()}, "model": {}}
  (run / "config.json").write_text(json.dumps(record))
  return str(run)


def test_resume_keeps_the_saved_schedule_and_batch(tmp_path):
  run = saved_run(tmp_path, steps=100, global_batch_size=8, num_layers=1)
  kept = config_lib.parse(["--resume", "--run-dir", run, "--steps", "200"])
  assert (kept.steps, kept.decay_steps, kept.warmup_steps, kept.num_layers) == (200, 100, 5, 1)
  stretched = config_lib.parse(["--resume", "--run-dir", run, "--steps", "200", "--lr-decay-steps", "200"])
  assert stretched.decay_steps == 200
  assert config_lib.parse(["--resume", "--run-dir", run]).decay_steps == 100
  with pytest.raises(config_lib.UsageError, match="--resume --global-batch-size 16: the run was saved with 8"):
    config_lib.parse(["--resume", "--run-dir", run, "--global-batch-size", "16"])


def test_remat_takes_a_policy_and_alone_means_full(tmp_path):
  assert (config_lib.parse([]).remat, config_lib.parse(["--remat"]).remat) == ("none", "full")
  assert config_lib.parse(["--remat", "custom:query_proj=host", "--steps", "3"]).remat == "custom:query_proj=host"
  for saved, read in ((True, "full"), (False, "none")):  # runs saved when --remat was a switch
    (tmp_path / str(saved)).mkdir()
    run = saved_run(tmp_path / str(saved), remat=saved)
    assert config_lib.parse(["--resume", "--run-dir", run]).remat == read
    assert config_lib.parse(["--config", os.path.join(run, "config.json")]).remat == read


def test_fp8_takes_a_recipe_and_alone_means_current(tmp_path):
  assert (config_lib.parse([]).fp8, config_lib.parse(["--fp8"]).fp8) == ("none", "current")
  config_file = tmp_path / "fp8.yaml"
  config_file.write_text("fp8: true\n")  # a config file's switch
  assert config_lib.parse(["--config", str(config_file)]).fp8 == "current"
  assert config_lib.parse(["--fp8", "delayed"]).fp8 == "delayed"
  with pytest.raises(config_lib.UsageError, match="^--fp8 bogus: unknown recipe; choose one of none, current, delayed"):
    config_lib.parse(["--fp8", "bogus"]).check()


def test_resume_without_config_json_reads_the_checkpoint(tmp_path):
  run = tmp_path / "run"
  for step, layers in ((2, 3), (4, 5)):
    (run / "checkpoints" / str(step) / "config").mkdir(parents=True)
    record = {"train": config_lib.Config(num_layers=layers).to_json(), "model": {}}
    (run / "checkpoints" / str(step) / "config" / "metadata").write_text(json.dumps(record))
  (run / "checkpoints" / "6").mkdir()  # an empty (damaged) newest step: skipped
  assert config_lib.parse(["--resume", "--run-dir", str(run)]).num_layers == 5
  assert rundir.checkpoint_record(str(run / "checkpoints"), 2)["train"]["num_layers"] == 3
  (run / "config.json").write_text("{}")  # damaged: the checkpoint stands in
  assert config_lib.parse(["--resume", "--run-dir", str(run)]).num_layers == 5
  os.rename(run / "checkpoints", tmp_path / "elsewhere")
  with pytest.raises(config_lib.UsageError, match="config.json is damaged"):
    config_lib.parse(["--resume", "--run-dir", str(run)])


def test_a_fine_tune_is_named_after_its_checkpoint(tmp_path):
  assert config_lib.Config(init_from="hf:/models/Qwen3-0.6B/").run_path == os.path.abspath("runs/Qwen3-0.6B-dion")
  assert config_lib.Config(optimizer="muon").run_path == os.path.abspath("runs/tiny-muon")

