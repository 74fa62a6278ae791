"""Hugging Face Hub ids (``train/store/hub.py``): ``--init-from hf:ORG/NAME`` read from a Hub cache
this test lays out as ``huggingface_hub`` does (``models--ORG--NAME/{refs,snapshots,blobs}``),
with ``HF_HUB_OFFLINE=1``, trains exactly as the same checkpoint in a local folder; so do
train.eval and the planner; a model missing offline is one line naming the cache; what is
fetched is config, tokenizer and safetensors only; ``train.export --push-to-hub`` hands the
exported folder to the Hub API (a stand-in here: no test reaches the network)."""
import fnmatch
import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import models
from tests.test_train_gpt import records, saved_state, subprocess_env
from train import eval as eval_lib
from train import export as export_lib
from train.plan import __main__ as plan_cmd
from train.store import hf as hf_io
from train.store import hub

huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the hub extra: pip install -e \".[dev]\"")
from huggingface_hub import constants, errors  # noqa: E402

REPO, COMMIT = "test-org/tiny-llama", "0123456789abcdef0123456789abcdef01234567"
FLAGS = ["--steps", "2", "--mesh", "fs=1", "--global-batch-size", "4", "--seq-len", "16", "--eval-tokens", "64",
         "--log-interval", "1", "--optimizer", "adamw", "--lr", "0.01"]
TIMING = ("ms_per_step", "tokens_per_s", "tflops_per_device", "mfu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random 1-layer Llama (byte vocabulary) as a Hugging Face folder, and a Hub cache
  holding the same files as revision ``main`` of REPO (files in blobs/ named by their
  sha256, linked from snapshots/COMMIT/, refs/main naming COMMIT)."""
  root = tmp_path_factory.mktemp("hub")
  cfg = models.preset("tiny", num_layers=1, d_model=32, num_heads=2, seq_len=16, mlp="swiglu", qk_norm="none")
  _, params = models.init(cfg, seed=0)
  params = jax.tree.map(np.asarray, dict(params, blocks=models.to_layers(params["blocks"], 1)))
  folder = root / "tiny-llama"
  hf_io.save(str(folder), cfg, params)
  (folder / "pytorch_model.bin").write_bytes(b"not fetched")  # a file a snapshot must leave out
  repo = root / "cache" / ("models--" + REPO.replace("/", "--"))
  for name in ("blobs", f"snapshots/{COMMIT}", "refs"):
    (repo / name).mkdir(parents=True)
  for name in sorted(os.listdir(folder)):
    content = (folder / name).read_bytes()
    blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
    blob.write_bytes(content)
    os.symlink(os.path.relpath(blob, repo / "snapshots" / COMMIT), repo / "snapshots" / COMMIT / name)
  (repo / "refs" / "main").write_text(COMMIT)
  return folder, root / "cache"


@pytest.fixture
def offline_cache(checkpoint, monkeypatch):
  """In this process: the Hub's cache is the test's, and offline."""
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(checkpoint[1]))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  hub._snapshot.cache_clear()
  yield checkpoint[1]
  hub._snapshot.cache_clear()


def run_gpt(run_dir, init_from, cache_dir, env_extra: dict) -> None:
  env = {**subprocess_env(str(cache_dir)), **env_extra}
  out = subprocess.run([sys.executable, "-m", "train.gpt", *FLAGS, "--init-from", init_from, "--run-dir", str(run_dir)],
                       env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]


def test_a_hub_id_trains_as_the_same_folder(checkpoint, tmp_path):
  """Two processes, each as a user starts it: one from the Hub id with HF_HUB_OFFLINE=1
  and HF_HUB_CACHE the test's cache, one from the folder; the same program on the same
  weights, so the same numbers to the bit."""
  folder, cache = checkpoint
  xla_cache = tmp_path / "xla"
  from_hub, from_folder = tmp_path / "from_hub", tmp_path / "from_folder"
  run_gpt(from_hub, f"hf:{REPO}", xla_cache, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
  run_gpt(from_folder, f"hf:{folder}", xla_cache, {})
  untimed = [[{k: v for k, v in r.items() if k not in TIMING} for r in records(d)] for d in (from_hub, from_folder)]
  assert untimed[0] == untimed[1] and len(untimed[0]) == 3
  for a, b in zip(jax.tree.leaves(saved_state(from_hub)), jax.tree.leaves(saved_state(from_folder)), strict=True):
    np.testing.assert_array_equal(a, b)
  configs = [json.loads((d / "config.json").read_text()) for d in (from_hub, from_folder)]
  assert configs[0]["model"] == configs[1]["model"] and configs[0]["hf_config"] == configs[1]["hf_config"]
  assert configs[0]["train"]["init_from"] == f"hf:{REPO}"


def test_eval_and_the_planner_read_hub_ids(checkpoint, offline_cache, capsys):
  folder, _ = checkpoint
  outputs = []
  for spec in (f"hf:{REPO}", f"hf:{REPO}@{COMMIT}", f"hf:{folder}"):
    assert eval_lib.main([spec, "--data", "stdlib:val", "--seq-len", "16", "--tokens", "128", "--mesh", "fs=1"]) == 0
    assert plan_cmd.main(["--model", spec, "--mesh", "fs=2", "--json"]) == 0
    loss, planned = capsys.readouterr().out.splitlines()
    assert json.loads(planned).pop("model") == spec
    outputs.append((loss, {k: v for k, v in json.loads(planned).items() if k != "model"}))
  assert outputs[0] == outputs[1] == outputs[2]


def test_a_missing_model_offline_is_one_line_naming_the_cache(tmp_path):
  """As a user meets it: a process with HF_HUB_OFFLINE=1 and an empty cache."""
  env = {**subprocess_env(str(tmp_path / "xla")), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty")}
  out = subprocess.run([sys.executable, "-m", "train.gpt", *FLAGS, "--init-from", "hf:test-org/absent",
                        "--run-dir", str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 2
  assert out.stderr.splitlines() == [
      f"error: hf:test-org/absent: not in the Hugging Face cache {tmp_path / 'empty'} and HF_HUB_OFFLINE is set;"
      " fetch it once with a network (or point HF_HUB_CACHE at a cache that holds it), or pass a local folder hf:DIR"]
  assert not (tmp_path / "run").exists()


def test_a_local_folder_wins_over_a_hub_id_of_the_same_name(checkpoint, tmp_path, monkeypatch):
  folder, _ = checkpoint
  monkeypatch.chdir(folder.parent.parent)  # so that the relative path "hub*/tiny-llama" is a folder
  relative = os.path.relpath(folder)
  assert hub.repo_id(relative) is not None  # it also has the form of a Hub id
  assert hub.local_dir(relative) == str(folder)


def test_only_config_tokenizer_and_safetensors_are_fetched(monkeypatch):
  calls = []
  monkeypatch.setattr(huggingface_hub, "snapshot_download",
                      lambda name, revision, allow_patterns: calls.append((name, revision, allow_patterns)) or "/x")
  hub._snapshot.cache_clear()
  try:
    assert hub.local_dir("org/model@v1") == "/x"
    assert hub.local_dir("org/model", weights=False) == "/x"
  finally:
    hub._snapshot.cache_clear()
  (name, revision, patterns), (_, plain, config_only) = calls
  assert (name, revision, plain, config_only) == ("org/model", "v1", None, ["config.json"])

  def fetched(file):
    return any(fnmatch.fnmatch(file, p) for p in patterns)

  assert all(map(fetched, ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                           "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]))
  assert not any(map(fetched, ["pytorch_model.bin", "model.pt", "original/consolidated.00.pth", "flax_model.msgpack"]))


class StandInHub:
  """What train.export calls of ``huggingface_hub.HfApi``, recording the uploaded files."""

  def __init__(self, fail: bool = False):
    self.repos, self.uploads, self.fail = [], [], fail

  def create_repo(self, repo_id, private, exist_ok):
    if self.fail:  # the error an HTTP 403 raises (built without its response: its constructor varies by version)
      error = errors.HfHubHTTPError.__new__(errors.HfHubHTTPError)
      Exception.__init__(error, "403 Forbidden: no write access")
      raise error
    self.repos.append((repo_id, private, exist_ok))

  def upload_folder(self, repo_id, folder_path, commit_message):
    self.uploads.append((repo_id, {n: open(os.path.join(folder_path, n), "rb").read() for n in os.listdir(folder_path)}))
    return type("CommitInfo", (), {"commit_url": f"https://hub.example/{repo_id}/commit/1"})()


@pytest.fixture(scope="module")
def trained_run(checkpoint, tmp_path_factory):
  from train import gpt

  run_dir = tmp_path_factory.mktemp("push") / "run"
  assert gpt.main([*FLAGS, "--steps", "1", "--init-from", f"hf:{checkpoint[0]}", "--run-dir", str(run_dir)]) == 0
  return run_dir


def test_push_to_hub_uploads_the_export(trained_run, tmp_path, monkeypatch, capsys):
  stand_in = StandInHub()
  monkeypatch.setattr(hub, "_api", lambda: stand_in)
  output = tmp_path / "export"
  assert export_lib.main([str(trained_run), "--output", str(output), "--push-to-hub", "me/tiny", "--private"]) == 0
  assert stand_in.repos == [("me/tiny", True, True)]
  ((repo, files),) = stand_in.uploads
  assert repo == "me/tiny" and files == {n: (output / n).read_bytes() for n in os.listdir(output)}
  assert "config.json" in files and "model.safetensors" in files
  assert capsys.readouterr().out.splitlines()[-1].endswith("to me/tiny: https://hub.example/me/tiny/commit/1")
  # Without --output the export goes to a temporary folder, the same files.
  assert export_lib.main([str(trained_run), "--push-to-hub", "me/tiny"]) == 0
  assert stand_in.uploads[1][1] == files


@pytest.mark.parametrize("argv, message", [
    (["--push-to-hub", "not-a-repo"], "--push-to-hub not-a-repo: expected ORG/NAME"),
    (["--push-to-hub", "me/tiny@main"], "--push-to-hub me/tiny@main: expected ORG/NAME"),
    ([], "--output DIR needed (or --push-to-hub ORG/NAME)"),
    (["--push-to-hub", "me/tiny", "FAIL"], "--push-to-hub me/tiny: the Hub answered 403 Forbidden: no write access"),
])
def test_push_to_hub_bad_input_is_one_line(trained_run, argv, message, monkeypatch, capsys):
  monkeypatch.setattr(hub, "_api", lambda: StandInHub(fail=True))
  assert export_lib.main([str(trained_run), *[a for a in argv if a != "FAIL"]]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: " + message), err
