"""python -m train.gpt end to end: the default command, resume, kill, reshard, multi-host, bad input.

Runs use a very small GPT (2 layers x 32, 16 tokens, batch 8) so that compilation dominates;
XLA's persistent compilation cache (conftest's, every program of a run here) lets runs of the
same program share it.
In-process runs see the 8 fake CPU devices of conftest.py; subprocess runs start their own JAX.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import data
from tests import xla_env
from tests.test_train_run_optim import expected_lr
from train import eval as eval_lib
from train import export as export_lib
from train import gpt

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-len", "16",
         "--global-batch-size", "8", "--eval-tokens", "128", "--log-interval", "1",
         "--dion-rank-fraction", "0.25", "--clip-grad", "0.5"]


@pytest.fixture(scope="module")
def compile_cache(xla_cache):
  """The run's XLA cache (conftest's), caching every program of this module's runs, in-process
  and in subprocesses, however short its compile."""
  data.load_source("stdlib", progress=False)  # build the corpus once, before parallel runs
  data.load_source("stdlib:val", progress=False)
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  yield xla_cache
  jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def subprocess_env(cache: str) -> dict:
  env = xla_env.subprocess_env()
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


# No validation in this module's runs (but the default command's): it would compile one more
# program per run and mesh; tests/test_train_run_evaluation.py checks evaluation.
NO_EVAL = ["--eval-tokens", "0"]


def train(run_dir, *args) -> int:
  return gpt.main([*SMALL, *NO_EVAL, "--run-dir", str(run_dir), *args])


def records(run_dir) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(run_dir) -> dict[int, float]:
  """Loss per step; a resumed run's later records win (a killed run may have logged past
  its last checkpoint)."""
  return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def saved_state(run_dir, step: int | None = None) -> dict:
  """The state of checkpoint ``step`` (the latest by default), as numpy arrays in the saved
  (layer-order) layout."""
  manager = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"),
                                  item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                                 "meta": ocp.JsonCheckpointHandler(),
                                                 "config": ocp.JsonCheckpointHandler()})
  step = manager.latest_step() if step is None else step
  meta = manager.item_metadata(step)["state"]
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=args)))
  manager.close()
  return state["state"]


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_default_command_trains(compile_cache, tmp_path, monkeypatch, capsys):
  """The README's first command, cut short: from another directory, tiny preset, Dion; and
  what the pages claim of its run (``tests/test_docs.py`` holds the pages' flags): the first
  logged loss (README: 6.6), the legend, one validation loss in the trainer's line and in
  ``train.eval RUN_DIR``'s, the one-line refusals of a finished ``--resume`` and of the
  default model's export."""
  out = subprocess.run([sys.executable, "-m", "train.gpt", "--steps", "4", "--log-interval", "2",
                        "--global-batch-size", "8", "--eval-tokens", "2048"],
                       cwd=tmp_path, env=subprocess_env(compile_cache), capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  run_dir = tmp_path / "runs" / "tiny-dion"
  lines = [l for l in out.stdout.splitlines() if l.startswith("iteration")]
  assert len(lines) == 3  # the first iteration as it ends, then every 2nd
  assert "each line: lm loss = the mean over the interval's applied steps, in nats per token" in out.stdout
  assert "grad norm = its last applied step's, before clipping to --clip-grad 1;" in out.stdout
  fields = ["iteration", "consumed tokens:", "elapsed time per iteration (ms):", "tokens/s:",
            "TFLOP/s per device:", "learning rate:", "lm loss:", "grad norm:",
            "skipped iterations: 0", "nan iterations: 0"]
  assert [f for f in fields if f not in lines[0]] == []
  assert "consumed tokens: 4096 " in lines[-1]
  losses = train_losses(run_dir)
  assert list(losses) == [1, 2, 4]
  assert round(losses[1], 1) == 6.6  # README: "falls from 6.6 (step 1, the first line)"
  assert losses[4] < losses[1] - 2.0  # a few Dion steps halve it (measured: 3.16 after 4 steps)
  assert json.load(open(run_dir / "config.json"))["model"]["num_layers"] == 4
  assert os.listdir(run_dir / "checkpoints") == ["4"]

  # training.md, huggingface.md: train.eval RUN_DIR prints the run's validation loss and count
  # the first validation compiles its step: a line says so before it (the run was silent until its result)
  validating = out.stdout.splitlines().index("validating at iteration 4: 16 rows of 128 tokens, 8 a pass"
                                             " (compiling the evaluation step first)")
  assert out.stdout.splitlines()[validating + 1].startswith("validation at iteration        4 |")
  trainer = [l for l in out.stdout.splitlines() if l.startswith("validation at iteration")][-1].split(" | ", 1)[1]
  assert trainer.startswith("validation lm loss: ") and trainer.endswith("| targets: 2048")
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  assert eval_lib.main(["runs/tiny-dion"]) == 0
  evaluated = capsys.readouterr().out.strip().splitlines()[-1]
  assert evaluated.startswith("validation lm loss: ") and "| targets: 2048 |" in evaluated
  # two compiled programs (the trainer's on fs=8, eval's on one device): within 1e-6, 7 digits
  assert float(evaluated.split()[3]) == pytest.approx(float(trainer.split()[3]), rel=1e-6)
  # README: --resume continues after a stop; a finished run's says how to go on, in one line
  for argv, advice in [(["--resume"], "--steps 8 --lr-decay-steps 8"),
                       (["--resume", "--steps", "5"], "pass --lr-decay-steps 5")]:
    assert gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and advice in err, err
  # huggingface.md: the default model does not export, and the line names the flags that would
  assert export_lib.main(["runs/tiny-dion", "--output", "exported"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--mlp swiglu --qk-norm none" in err and not (tmp_path / "exported").exists()


RESUMED = ["--mesh", "rp=2,fs=2,tp=2", "--lr", "0.02", "--min-lr", "0.002", "--lr-warmup-steps", "5",
           "--lr-decay-style", "linear", "--grad-norm", "exact"]


@pytest.fixture(scope="module")
def straight(compile_cache, tmp_path_factory):
  """8 steps on rp=2,fs=2,tp=2 (per-replica Dion momentum, clipped by the exact norm of the
  replicas' mean gradient) with a warmup into a linear decay, saved at 4 and 8: the
  uninterrupted reference that the resumed and resharded runs below must reach."""
  run_dir = tmp_path_factory.mktemp("straight") / "run"
  assert train(run_dir, *RESUMED, "--steps", "8", "--save-every", "4") == 0
  return run_dir


def test_resume_continues_bit_identically(straight, tmp_path):
  """8 steps straight == 4 steps, then --resume to 8 (per-replica Dion momentum included);
  the resume falls inside the warmup, and the learning rates across the warmup's end and
  the decay follow Megatron's formulas."""
  assert train(tmp_path / "split", *RESUMED, "--steps", "4", "--lr-decay-steps", "8") == 0
  assert gpt.main(["--run-dir", str(tmp_path / "split"), "--resume", "--steps", "8"]) == 0
  assert_trees_equal(saved_state(straight), saved_state(tmp_path / "split"))
  assert train_losses(straight) == train_losses(tmp_path / "split")
  lrs = {r["step"]: r["learning_rate"] for r in records(tmp_path / "split") if "learning_rate" in r}
  want = {s: expected_lr(s - 1, 0.02, 0.002, 5, 8, "linear", None) for s in range(1, 9)}
  assert lrs.keys() == want.keys()
  np.testing.assert_allclose([lrs[s] for s in want], list(want.values()), rtol=1e-6)


def test_an_offloaded_optimizer_state_trains_and_resumes_as_on_the_device(straight, tmp_path):
  """--offload-optimizer (Dion's state, per-replica momentum included, in pinned host memory
  between steps) against the same run without it (``straight``, on the device): 4 steps, then
  its checkpoint resumed (the state put back in host memory) to step 8; losses and final state
  within float32 rounding (measured equal on this CPU). AdamW's: docs/memory.md's measurement."""
  host = tmp_path / "host"
  assert train(host, *RESUMED, "--steps", "4", "--lr-decay-steps", "8", "--offload-optimizer") == 0
  want = train_losses(straight)
  np.testing.assert_allclose([train_losses(host)[s] for s in range(1, 5)], [want[s] for s in range(1, 5)],
                             rtol=1e-6)
  assert gpt.main(["--run-dir", str(host), "--resume", "--steps", "8"]) == 0
  assert json.load(open(host / "config.json"))["train"]["offload_optimizer"] is True
  np.testing.assert_allclose([train_losses(host)[s] for s in range(5, 9)], [want[s] for s in range(5, 9)],
                             rtol=1e-6)
  for a, b in zip(jax.tree.leaves(saved_state(host)), jax.tree.leaves(saved_state(straight))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(compile_cache, straight, tmp_path):
  """Killed (SIGKILL) once its first checkpoint is whole, a few steps in, with the next save
  under way: --resume continues to the state of the run that never stopped (``straight``,
  whose program the killed run and its resume share), bit for bit."""
  killed = tmp_path / "killed"
  proc = subprocess.Popen([sys.executable, "-m", "train.gpt", *SMALL, *NO_EVAL, *RESUMED, "--steps", "8",
                           "--save-every", "2", "--run-dir", str(killed)],
                          env=subprocess_env(compile_cache), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  ckpts = killed / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if ckpts.is_dir() and any(n.isdigit() for n in os.listdir(ckpts)):
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)  # while it trains, with an asynchronous save under way
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
  assert max(int(n) for n in os.listdir(ckpts) if n.isdigit()) < 8
  assert gpt.main(["--run-dir", str(killed), "--resume"]) == 0
  assert_trees_equal(saved_state(straight), saved_state(killed))


def stopped_after(run_dir, step: int, copy) -> int:
  """Copies ``run_dir`` to ``copy`` as if the run had stopped once it saved ``step`` (its later
  checkpoints removed); returns how many records the log holds (a resume appends after them)."""
  shutil.copytree(run_dir, copy)
  for name in os.listdir(copy / "checkpoints"):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(copy / "checkpoints" / name)
  return len(records(copy))


def test_reshard_onto_other_meshes(straight, tmp_path):
  """``straight``'s step-4 checkpoint (rp=2,fs=2,tp=2, a Dion momentum per replica) resumes on
  fs=2,cp=2,pp=2, whose every axis lays the state out otherwise: the two replicas' momenta
  averaged into one state, context parallelism, and the layers split into pipeline stages,
  each stage's arrays whole, as on one device. The next steps' losses and gradient norms
  match the original run's within 1e-5 (clipped by the exact norm of the replicas' mean
  gradient on rp, --grad-norm exact, the norm of one replica's). One replica into two is the
  mixture of experts' reshard."""
  mesh = "fs=2,cp=2,pp=2"
  run_dir = tmp_path / "resharded"
  logged = stopped_after(straight, 4, run_dir)
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--mesh", mesh, "--steps", "6",
                   "--lr-decay-steps", "8"]) == 0
  ref = {r["step"]: r for r in records(straight) if "loss" in r}
  new = {r["step"]: r for r in records(run_dir)[logged:] if "loss" in r}
  assert sorted(new) == [5, 6]
  for step, r in new.items():
    np.testing.assert_allclose(r["loss"], ref[step]["loss"], rtol=0, atol=1e-5, err_msg=mesh)
    np.testing.assert_allclose(r["grad_norm"], ref[step]["grad_norm"], rtol=1e-5, err_msg=mesh)


def test_moe_reshards_onto_other_expert_layouts(compile_cache, tmp_path):
  """The step-3 checkpoint of a mixture-of-experts run (experts on every second layer) on
  fs=2,ep=4 resumes on rp=2,ep=2,tp=2 (one state into two replicas' Dion momenta) and matches
  the original run's next steps; its log has the routing figures. Clipped by the norm of the
  replicas' mean gradient (--grad-norm exact), as one replica is."""
  moe = ("--preset", "tiny-moe", "--moe-every", "2", "--moe-capacity-factor", "1.0", "--grad-norm", "exact")
  assert train(tmp_path / "ref", *moe, "--mesh", "fs=2,ep=4", "--steps", "5", "--save-every", "3") == 0
  run_dir = tmp_path / "resumed"
  logged = stopped_after(tmp_path / "ref", 3, run_dir)
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--mesh", "rp=2,ep=2,tp=2", "--steps", "5"]) == 0
  ref = {r["step"]: r for r in records(tmp_path / "ref") if "loss" in r}
  new = {r["step"]: r for r in records(run_dir)[logged:] if "loss" in r}
  assert sorted(new) == [4, 5]
  for step, r in new.items():
    for key in ("loss", "moe_aux_loss", "expert_load", "dropped"):
      np.testing.assert_allclose(r[key], ref[step][key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert all(r["expert_load"] >= 1 and 0 <= r["dropped"] < 1 and r["moe_aux_loss"] > 0 for r in ref.values())


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(compile_cache, tmp_path):
  """Two processes x 2 CPU devices (gloo) on fs=2,tp=2 train like one process with 4 devices,
  and their checkpoint resumes on one process, continuing as that one process's run (which
  goes on to step 6 without stopping: test_resume_continues_bit_identically shows that a
  resume and a run that never stopped are one)."""
  args = [*SMALL, *NO_EVAL, "--mesh", "fs=2,tp=2", "--steps", "4", "--lr-decay-steps", "6"]
  multi = tmp_path / "multi"
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "train.gpt", *args, "--run-dir", str(multi),
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                             "--process-id", str(i)],
                            env=subprocess_env(compile_cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
  assert "(2 processes)" in outs[0][0] and "iteration" not in outs[1][0]  # only process 0 logs
  single = tmp_path / "single"
  assert train(single, *args[len(SMALL):], "--steps", "6", "--save-every", "4") == 0
  multi_losses, single_losses = train_losses(multi), train_losses(single)
  assert sorted(multi_losses) == [1, 2, 3, 4]
  np.testing.assert_allclose(list(multi_losses.values()), [single_losses[s] for s in multi_losses], atol=1e-5)
  # gloo's reductions round apart from one process's, through 4 Dion steps: at most 1.06e-5
  # (jax 0.12 on Python 3.12's corpus; under 1e-5 on 0.10.2, and on 0.12 with 3.11's corpus).
  for a, b in zip(jax.tree.leaves(saved_state(multi)), jax.tree.leaves(saved_state(single, 4))):
    np.testing.assert_allclose(a, b, atol=2e-5)
  # Onto one process (4 of conftest's 8 devices): the next steps continue the data and state.
  assert gpt.main(["--run-dir", str(multi), "--resume", "--steps", "6"]) == 0
  np.testing.assert_allclose([train_losses(multi)[s] for s in (5, 6)], [single_losses[s] for s in (5, 6)],
                             atol=1e-5)


def snapshot(path) -> dict:
  """Every file under ``path`` with its bytes: to check that nothing was written."""
  out = {}
  for root, _, files in os.walk(path):
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        out[os.path.join(root, name)] = f.read()
  return out


def test_bad_input_one_line_exit_2_nothing_written(straight, tmp_path, capsys):
  done = tmp_path / "done"
  shutil.copytree(straight, done)  # a finished run of 8 steps
  empty = tmp_path / "empty" / "checkpoints"
  empty.mkdir(parents=True)
  before = snapshot(tmp_path)
  fresh = str(tmp_path / "fresh")
  cases = [
      (["--preset", "huge", "--run-dir", fresh], "invalid choice: 'huge'"),
      (["--mesh", "fs=16", "--run-dir", fresh], "needs 16 devices but 8 cpu devices exist"),
      (["--mesh", "fs=2,tq=2", "--run-dir", fresh], "unknown axis 'tq'"),
      (["--mesh", "fs=4", "--global-batch-size", "6", "--run-dir", fresh],
       "--global-batch-size 6 does not split over the 4 data-parallel ranks"),
      (["--mesh", "fs=2", "--micro-batch-size", "3", "--run-dir", fresh],
       "--micro-batch-size 3 does not divide the 4 sequences"),
      (["--mesh", "pp=3", "--run-dir", fresh],  # not "--micro-batch-size 2 does not divide", a flag not given
       "--mesh pp=3 needs micro-batches in multiples of 3, and each data-parallel rank's 8 sequences"),
      (["--mesh", "pp=2", "--micro-batch-size", "8", "--run-dir", fresh],
       "--micro-batch-size 8 makes 1 micro-batches of the 8 sequences per data-parallel rank, and the"
       " pipeline (--mesh pp=2) needs a multiple of 2; choose a --micro-batch-size that divides 4"),
      (["--mesh", "cp=4", "--seq-len", "12", "--run-dir", fresh],
       "--seq-len / --mesh: sequence length 12 does not split into 2·cp = 8 chunks"),
      (["--data", str(tmp_path / "missing_*.bin"), "--run-dir", fresh], "missing_*.bin"),
      (["--resume", "--run-dir", fresh], "does not exist"),
      (["--resume", "--run-dir", str(tmp_path / "empty")], "holds no complete checkpoint"),
      (["--run-dir", str(done), "--steps", "16"], "already holds checkpoints (latest step 8)"),
      (["--run-dir", str(done), "--resume", "--steps", "16", "--hidden-size", "64"],
       "is of another model: d_model=32 (now 64)"),
      (["--run-dir", str(done), "--resume", "--steps", "16", "--optimizer", "adamw"],
       "holds --optimizer dion state"),
      (["--run-dir", str(done), "--resume", "--steps", "8"], "its checkpoint at step 8 reaches --steps 8"),
      (["--steps", "0", "--run-dir", fresh], "--steps must be positive"),
      (["--preset", "tiny-moe", "--num-experts", "6", "--mesh", "ep=4", "--run-dir", fresh],
       "--mesh ep=4 does not divide the 6 experts"),
      (["--preset", "tiny-moe", "--moe-top-k", "9", "--run-dir", fresh],
       "moe_top_k=9 must be between 1 and num_experts=8"),
      (["--preset", "tiny-moe", "--moe-every", "3", "--run-dir", fresh],
       "moe_every=3 does not divide num_layers=2"),
      (["--preset", "tiny", "--moe-every", "2", "--run-dir", fresh], "num_experts is 0"),
      (["--preset", "tiny-moe", "--moe-every", "2", "--mesh", "pp=2", "--run-dir", fresh],
       "2 layers (in groups of moe_every=2) do not split into 2 pipeline stages"),
  ]
  for args, message in cases:
    capsys.readouterr()
    assert train(fresh, *args) == 2, args
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (args, err)
  assert snapshot(tmp_path) == before
  assert not os.path.exists(fresh)


def test_megatron_data_needs_a_vocab_size(tmp_path, capsys):
  from data import megatron

  prefix = str(tmp_path / "toks")
  megatron.write_dataset(prefix, [np.arange(200, dtype=np.uint16) % 50])
  assert gpt.main(["--data", f"megatron:{prefix}", "--run-dir", str(tmp_path / "run")]) == 2
  assert "pass --vocab-size" in capsys.readouterr().err


def test_non_finite_steps_change_nothing_and_stop_the_run(compile_cache, tmp_path, capsys):
  """AdamW at lr 1e30 leaves parameters near 1e30 after step 1, whose gradients overflow: the
  following steps are skipped (the state saved at their end is the one saved after step 1),
  counted, and the run stops."""
  blowup = ["--optimizer", "adamw", "--lr", "1e30", "--lr-decay-style", "constant",
            "--lr-warmup-steps", "0", "--mesh", "fs=2", "--save-every", "1", "--keep", "10"]
  capsys.readouterr()
  assert train(tmp_path / "run", *blowup, "--steps", "10", "--max-skipped", "3") == 3
  err = capsys.readouterr().err
  assert err.startswith("error: stopped after 3 consecutive iterations") and err.count("\n") == 1
  assert [(r["step"], r["skipped"]) for r in records(tmp_path / "run") if "loss" in r] == \
      [(1, 0), (2, 1), (3, 1), (4, 1)]
  saved = sorted(int(n) for n in os.listdir(tmp_path / "run" / "checkpoints"))
  assert saved[0] == 1 and saved[-1] >= 3, saved  # the latest after skipped steps
  after_one = saved_state(tmp_path / "run", 1)
  assert np.abs(after_one["params"]["lm_head"]["kernel"]).max() > 1e20  # step 1 applied lr 1e30
  assert_trees_equal(after_one, saved_state(tmp_path / "run"))


def test_qk_clip_on_a_mesh_matches_one_device(compile_cache, tmp_path, capsys):
  """QK-clip at a threshold that the first step crosses: the same losses, largest logits and
  clipped heads on fs=2,tp=2 as on one device, heads clipped at exactly the steps whose
  largest logit crosses it, and logged; refused with QK-norm.

  Later steps cross it or not as their data goes: the corpus is the running Python's
  standard library (with 3.11's every step crossed; with 3.12's the second's 1.93 did not)."""
  args = ("--qk-norm", "none", "--qk-clip-threshold", "2", "--steps", "3", "--optimizer", "nordion2",
          "--ortho-dtype", "float32")
  assert train(tmp_path / "one", *args, "--mesh", "fs=1") == 0
  assert train(tmp_path / "mesh", *args, "--mesh", "fs=2,tp=2") == 0
  one, mesh = ([r for r in records(tmp_path / d) if "loss" in r] for d in ("one", "mesh"))
  assert [r["clipped_heads"] for r in one] == [r["clipped_heads"] for r in mesh]
  assert one[0]["max_logit"] > 2 and all((r["clipped_heads"] > 0) == (r["max_logit"] > 2) for r in one)
  for key in ("loss", "max_logit"):
    np.testing.assert_allclose([r[key] for r in mesh], [r[key] for r in one], rtol=1e-5)
  capsys.readouterr()
  assert train(tmp_path / "refused", "--qk-clip-threshold", "2") == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --qk-clip-threshold: QK-clip scales") and err.count("\n") == 1
  assert not os.path.exists(tmp_path / "refused")


def test_fp8_on_a_mesh_matches_one_device(compile_cache, tmp_path, capsys):
  """--fp8 on rp=2,fs=2,tp=2 (each replica's gradient in the shard_map manual over rp, its
  scales maxed over the replicas): one device's losses within float32 rounding (measured:
  2e-7). AdamW, whose step compiles fastest; with Dion too on this mesh (measured: 2e-7).
  Dion on tp=2 with two micro-batches of 4 leaves one device's losses at step 3 by 1e-2:
  a value one float32 ulp from an e5m2 rounding tie rounds the other way on tp, FP8's own
  noise, not a scale (docs/fp8.md; tests/test_models_fp8.py holds the scales on tp).
  Both in 4 micro-batches (rows i, i + 4, ...: 4 per data-parallel rank of the mesh, 1 of
  its 4 ranks). train.eval of the run prints the trainer's own validation loss: FP8 scales
  each product by its amax over the rows it multiplies, so it repeats the trainer's pass
  (--global-batch-size 16 in its 4 micro-batches; its own default, 8 rows whole, and 16 rows
  whole each printed another number)."""
  for name, mesh, micro in (("one", "fs=1", "4"), ("mesh", "rp=2,fs=2,tp=2", "1")):
    assert train(tmp_path / name, "--fp8", "--optimizer", "adamw", "--steps", "3", "--eval-tokens", "512",
                 "--global-batch-size", "16", "--micro-batch-size", micro, "--mesh", mesh) == 0
  one = list(train_losses(tmp_path / "one").values())
  assert len(one) == 3
  np.testing.assert_allclose(list(train_losses(tmp_path / "mesh").values()), one, rtol=1e-5)
  trainer = [r["val_loss"] for r in records(tmp_path / "one") if "val_loss" in r]
  assert eval_lib.main([str(tmp_path / "one")]) == 0
  assert capsys.readouterr().out.splitlines()[-1].startswith(f"validation lm loss: {trainer[-1]:.6E} |")


def test_dion_split_q_restores_either_layout_and_trains_as_without(straight, tmp_path):
  """``straight``'s step-4 checkpoint (rp=2,fs=2,tp=2, Q replicated over tp) resumes with
  --dion-split-q (Q's r split over tp: the same global arrays, laid out otherwise) to step 6,
  whose checkpoint, saved in the split layout, resumes to step 8: the losses and gradient
  norms of steps 5-8 are straight's within 1e-5 and the final state within float32 rounding
  (achieved: about 1e-7)."""
  run_dir = tmp_path / "split_q"
  logged = stopped_after(straight, 4, run_dir)
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--dion-split-q", "--steps", "6",
                   "--lr-decay-steps", "8"]) == 0
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--steps", "8"]) == 0
  assert json.load(open(run_dir / "config.json"))["train"]["dion_split_q"] is True
  ref = {r["step"]: r for r in records(straight) if "loss" in r}
  new = {r["step"]: r for r in records(run_dir)[logged:] if "loss" in r}
  assert sorted(new) == [5, 6, 7, 8]
  for step, r in new.items():
    np.testing.assert_allclose(r["loss"], ref[step]["loss"], rtol=0, atol=1e-5, err_msg=str(step))
    np.testing.assert_allclose(r["grad_norm"], ref[step]["grad_norm"], rtol=1e-5, err_msg=str(step))
  for a, b in zip(jax.tree.leaves(saved_state(run_dir)), jax.tree.leaves(saved_state(straight))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
