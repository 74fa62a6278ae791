"""Faults and bad input of ``python -m train.gpt``: a busy or unusable run directory, an old
run's log, data the model cannot hold, Ctrl-C / SIGTERM, a failed save. Each is one
``error:`` line and its exit code, with nothing written or the previous state intact.

Runs use the smallest GPT that trains (1 layer x 32, 16 tokens, batch 8) on one device, and
one lr schedule (--lr-decay-steps 1000) whatever their --steps: its constants are part of the
compiled step, which the tests then share through the persistent compilation cache.
"""
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from data import fineweb
from tests import xla_env
from tests.test_train_gpt import compile_cache, snapshot, subprocess_env  # noqa: F401  fixture
from train import cli, gpt
from train.run import config as config_lib
from train.run import interrupt as interrupt_lib
from train.run import preflight
from train.run import restore as restore_lib
from train.store import rundir

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-len", "16",
        "--global-batch-size", "8", "--eval-tokens", "128", "--log-interval", "1", "--mesh", "fs=1",
        "--lr-decay-steps", "1000"]


def train(run_dir, *args) -> int:
  return gpt.main([*TINY, "--run-dir", str(run_dir), *args])


def one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1, err
  return err


def dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def write_lock(run_dir, host: str, pid: int) -> None:
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, rundir.LOCK_NAME), "w") as f:
    json.dump({"host": host, "pid": pid}, f)


def test_busy_unusable_or_used_run_directories_are_refused(compile_cache, tmp_path, capsys):  # noqa: F811
  done = tmp_path / "done"
  write_lock(done, socket.gethostname(), dead_pid())  # a killed run's lock: stale, taken over
  assert train(done, "--steps", "2", "--eval-tokens", "0") == 0
  assert not (done / rundir.LOCK_NAME).exists()  # released at the end
  capsys.readouterr()

  busy = tmp_path / "busy"
  write_lock(busy, socket.gethostname(), os.getpid())  # a live process on this host
  remote = tmp_path / "remote"
  write_lock(remote, "another-host", 1)  # cannot be checked from here: refused too
  old_log = tmp_path / "old_log"  # a run killed before its first checkpoint
  old_log.mkdir()
  (old_log / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  small_valid = tmp_path / "small_valid.bin"  # 10 tokens: no window of 17 (fewer than a batch is fine)
  fineweb.write_shard(str(small_valid), np.arange(10))
  high_ids = tmp_path / "high_ids.bin"
  fineweb.write_shard(str(high_ids), np.where(np.arange(5000) == 777, 307, np.arange(5000) % 256))
  before = snapshot(tmp_path)
  fresh = tmp_path / "fresh"
  cases = [
      ([], busy, f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}"),
      ([], remote, "(pid 1 on host another-host"),
      (["--resume"], busy, "is in use by another run"),
      ([], a_file, f"--run-dir {a_file} is a file, not a directory"),
      (["--resume"], a_file, f"--run-dir {a_file} is a file, not a directory"),
      ([], a_file / "run", f"lies under the file {a_file}"),
      (["--ckpt-dir", str(a_file)], fresh, f"--ckpt-dir {a_file} is a file"),
      ([], old_log, "already holds a run's metrics.jsonl but no checkpoint; choose a new --run-dir"),
      (["--valid-data", f"fineweb:{small_valid}", "--vocab-size", "257"], fresh,
       "--valid-data: " + str(small_valid) + ": seq_len 16 needs windows of 17 tokens but the longest token"
       " stream has 10"),
      (["--vocab-size", "100"], fresh, "--data stdlib holds token id 256 but the model's vocabulary has 100 ids"),
      # padded to 384 rows, a 257-token vocabulary would train on id 307 silently
      (["--data", f"fineweb:{high_ids}", "--vocab-size", "257", "--eval-tokens", "0"], fresh,
       "holds token id 307 but the model's vocabulary has 257 ids (0..256); pass --vocab-size 308"),
  ]
  for args, run_dir, message in cases:
    assert train(run_dir, "--steps", "2", *args) == 2, args
    assert message in one_error_line(capsys), args
  assert snapshot(tmp_path) == before
  assert not fresh.exists()


def stop_at(run_dir, step: int, signum: int) -> threading.Thread:
  """Sends ``signum`` to this process once metrics.jsonl holds the record of ``step``."""
  def watch():
    path = os.path.join(run_dir, "metrics.jsonl")
    while True:
      if os.path.exists(path):
        with open(path) as f:
          if any(json.loads(line).get("step") == step for line in f if line.strip()):
            break
      time.sleep(0.01)
    os.kill(os.getpid(), signum)

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


def steps_saved(run_dir) -> list[str]:
  return sorted(os.listdir(run_dir / "checkpoints"))


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_saves_and_exits(compile_cache, tmp_path, capsys, signum, code):  # noqa: F811
  """The signal comes once step 3 is logged (the loop is then a step or two further: it logs
  a step after dispatching the next): the run finishes the step it is on, logs it and saves
  it, although --save-every 0 saves only at the end. Then the handler it found is back:
  Python's ``default_int_handler`` for SIGINT, or ``SIG_IGN`` where the suite started with
  SIGINT ignored (``nohup``, or ``&`` in a script), which the run overrode meanwhile."""
  run_dir = tmp_path / "run"
  found = signal.getsignal(signum)
  stop_at(run_dir, 3, signum)
  assert train(run_dir, "--steps", "1000", "--save-every", "0") == code
  err = one_error_line(capsys)
  saved = steps_saved(run_dir)
  assert len(saved) == 1 and 3 <= int(saved[0]) < 1000, saved  # nothing partial left
  logged = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
  assert logged == list(range(1, int(saved[0]) + 1))
  assert err.startswith(f"error: stopped by {signal.Signals(signum).name} after step {saved[0]};"
                        f" the checkpoint of step {saved[0]} is saved in")
  # the whole command: a bare --resume would continue the default run directory, not this one
  assert err.endswith(f"; continue with: python -m train.gpt --run-dir {run_dir} --resume\n"), err
  assert not (run_dir / rundir.LOCK_NAME).exists()
  assert found is not None and signal.getsignal(signum) == found


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_step(compile_cache, tmp_path):  # noqa: F811
  """Two processes (gloo on 127.0.0.1, one CPU device each): SIGTERM reaches process 0 only,
  once step 3 is logged; both agree on it, save the same step together and exit 143."""
  run_dir = tmp_path / "run"
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, "-m", "train.gpt", *TINY, "--mesh", "fs=2", "--run-dir", str(run_dir),
                             "--steps", "1000", "--save-every", "0", "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", "2", "--process-id", str(i)],
                            env=subprocess_env(compile_cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
           for i in range(2)]
  try:
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and any(json.loads(line)["step"] == 3 for line in open(metrics) if "loss" in line)):
      assert procs[0].poll() is None, procs[0].stderr.read()[-3000:]
      time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)
    errs = [p.communicate(timeout=120)[1] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [143, 143], errs[0][-3000:] + errs[1][-3000:]
  saved = steps_saved(run_dir)
  assert len(saved) == 1 and 3 <= int(saved[0]) < 1000, saved
  last = [e.strip().splitlines()[-1] for e in errs]
  assert last[0].startswith(f"error: stopped by SIGTERM after step {saved[0]}; the checkpoint of step {saved[0]}"), last
  assert last[1].startswith(f"error: stopped by SIGTERM sent to another process after step {saved[0]};"
                            f" the checkpoint of step {saved[0]}"), last


SECOND_SIGNAL = """
import sys, time
from train.store import rundir
from train.run.interrupt import Interrupt
with Interrupt(on_second=lambda: rundir.remove_partial_saves(sys.argv[1])) as interrupt:
  print("ready", flush=True)
  while interrupt.signum is None:
    time.sleep(0.01)
  print("saving", flush=True)  # as a long save would, the first signal's exit waits
  time.sleep(60)
"""


def _ignore_sigint() -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_exits_at_once_without_partial_saves(tmp_path, signum, code):
  """The second signal, while the first one's save runs, exits at once with 128 + signum and
  removes the unfinished save. The process starts with SIGINT ignored, as one started with
  ``nohup`` or by ``&`` in a script inherits it: the run still takes SIGINT."""
  partial = tmp_path / f"7{rundir.PARTIAL_MARK}"
  partial.mkdir()
  (tmp_path / "6").mkdir()
  proc = subprocess.Popen([sys.executable, "-c", SECOND_SIGNAL, str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
                          preexec_fn=_ignore_sigint)
  assert proc.stdout.readline() == "ready\n"
  proc.send_signal(signum)
  assert proc.stdout.readline() == "saving\n"
  proc.send_signal(signum)
  assert proc.wait(timeout=30) == code
  assert os.listdir(tmp_path) == ["6"]
  # the first was answered at once (the steps under way may take minutes), the second not
  name = signal.Signals(signum).name
  assert proc.stderr.read() == (f"{name}: stopping after the steps under way, saving the last; {name} again exits"
                                " at once, without that save\n")


def test_the_run_takes_sigint_even_where_it_was_ignored_and_gives_it_back():
  """Under ``nohup`` or ``&`` in a script SIGINT starts ignored: the run's handler takes it
  all the same (``kill -INT`` stops the run at a step, saved), and the ignoring is back after."""
  found = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    with interrupt_lib.Interrupt(on_second=lambda: None) as interrupt:
      os.kill(os.getpid(), signal.SIGINT)
      deadline = time.monotonic() + 10
      while interrupt.signum is None and time.monotonic() < deadline:
        time.sleep(0.01)
      assert interrupt.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, found)


def test_a_failed_save_stops_the_run_at_the_next_step_and_keeps_the_previous_checkpoint(  # noqa: F811
    compile_cache, tmp_path, capsys, monkeypatch):  # noqa: F811
  """The background write of step 4's checkpoint fails as on a full disk: the run stops at
  step 5, the first step after the write ended (not at the next save, step 6), with one line
  naming the directory and the cause (exit 1); step 2's checkpoint stays complete, nothing
  partial is left."""
  from orbax.checkpoint._src.path import atomicity

  from train.run import loop

  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def disk_full(self, *args, **kwargs):
    if os.path.basename(str(self._final_path)) == "4":
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._tmp_path))
    return await finalize(self, *args, **kwargs)

  global_batch = loop.global_batch

  def after_the_save(run, local):  # as on a model whose step outlasts the background write
    while run.checkpoints.manager.is_saving_in_progress():
      time.sleep(0.01)
    return global_batch(run, local)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
  monkeypatch.setattr(loop, "global_batch", after_the_save)
  run_dir = tmp_path / "run"
  assert train(run_dir, "--steps", "8", "--save-every", "2", "--keep", "5") == 1
  err = one_error_line(capsys)
  assert err.startswith(f"error: saving the checkpoint of step 4 to {run_dir / 'checkpoints'} failed:"
                        " No space left on device")
  assert "the checkpoint of step 2 is intact" in err
  logged = [r["step"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r]
  assert logged == [1, 2, 3, 4]  # step 5 ran and found the error before it was logged
  assert steps_saved(run_dir) == ["2"]
  assert (run_dir / "checkpoints" / "2" / "commit_success.txt").exists()
  assert not (run_dir / rundir.LOCK_NAME).exists()


def test_resume_reads_the_checkpoint_config_and_refuses_damaged_checkpoints(compile_cache, tmp_path, capsys):  # noqa: F811
  """Without config.json --resume takes the checkpoint's config; a damaged latest checkpoint is one line naming the step and
  the --step that goes back, in train.gpt, train.eval and train.export; --resume --step
  continues from the older one."""
  from train import eval as eval_lib
  from train import export as export_lib

  run_dir = tmp_path / "run"
  assert train(run_dir, "--steps", "2", "--save-every", "1", "--keep", "5", "--eval-tokens", "0") == 0
  (run_dir / "config.json").unlink()
  capsys.readouterr()
  # No model flags: the defaults (4 layers x 128) would not match the checkpoint.
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--steps", "3", "--lr-decay-steps", "3"]) == 0
  assert capsys.readouterr().err == ""
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--steps", "4", "--global-batch-size", "16"]) == 2
  assert "the run was saved with 8" in one_error_line(capsys)

  for name in os.listdir(run_dir / "checkpoints" / "3"):  # step 3 emptied
    path = run_dir / "checkpoints" / "3" / name
    subprocess.run(["rm", "-rf", str(path)], check=True)
  before = snapshot(tmp_path)
  damaged = f"the checkpoint of step 3 in {run_dir / 'checkpoints'} is damaged ("
  for main, argv, back in [
      (gpt.main, ["--run-dir", str(run_dir), "--resume", "--steps", "4"], "use an older one with --resume --step 2"),
      (eval_lib.main, [str(run_dir), "--data", "stdlib:val", "--seq-len", "16"], "use an older one with --step 2"),
      (export_lib.main, [str(run_dir), "--output", str(tmp_path / "hf")], "use an older one with --step 2")]:
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert damaged in err and err.endswith(back + "\n"), err
  assert snapshot(tmp_path) == before and not (tmp_path / "hf").exists()
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--step", "2", "--steps", "3"]) == 0
  assert steps_saved(run_dir) == ["1", "2", "3"]
  assert "deleting the newer checkpoints of steps 3" in capsys.readouterr().err
  # Truncated tensor files: TensorStore's read error (a ValueError here; a bare Exception from Orbax's sharded reads).
  for path in (run_dir / "checkpoints" / "3" / "state").rglob("d/*"):  # OCDBT's data files
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
  with pytest.raises(cli.UsageError, match="^" + re.escape(damaged) + r"ValueError: OUT_OF_RANGE: .*\); use an older one with --step 2$"):
    restore_lib.restore(str(run_dir))
  # A resumed train.grpo run's start, moved away: no --step (which picks the resumed run's own) is named
  with pytest.raises(cli.UsageError, match=f"^{re.escape(str(run_dir / 'checkpoints'))} has no checkpoint of step 4,"
                                           r" which --resume reads .*from step 3, the latest, which --init-from takes$"):
    restore_lib.restore(str(run_dir), 4, picks_step=preflight.RESUMED_START)

  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text("{}")
  assert gpt.main(["--run-dir", str(broken), "--resume"]) == 2
  assert "config.json is damaged" in one_error_line(capsys)


@pytest.mark.parametrize("error, damage", [
    (KeyError('Item "state" was not found in the checkpoint'), True),  # an emptied step directory
    (json.JSONDecodeError("Expecting value", "{trunc", 6), True),  # a truncated _METADATA
    (FileNotFoundError(errno.ENOENT, "No such file or directory"), True),
    (Exception("Encountered error while reading array index"), True),  # TensorStore's, via Orbax
    (TypeError("unsupported operand type(s)"), False), (AttributeError("no attribute 'pp'"), False),
    (RuntimeError("a bug"), False)])
def test_only_the_errors_of_damage_read_as_a_damaged_checkpoint(tmp_path, monkeypatch, error, damage):
  """A damaged checkpoint is one line; any other error while reading it (a bug) keeps its type and traceback.
  After damage, the "Event loop is closed" that TensorStore reports for each of Orbax's abandoned reads
  (dozens of tracebacks around the line) is dropped, and nothing else; after a bug, nothing is."""
  for step in (1, 2):
    (tmp_path / str(step)).mkdir()
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_value))

  def read():
    with preflight.reading("--step", str(tmp_path), 2):
      raise error

  if damage:
    with pytest.raises(cli.UsageError, match=f"^the checkpoint of step 2 in {re.escape(str(tmp_path))} is damaged"
                                             f" \\({type(error).__name__}: .*\\); use an older one with --step 1$"):
      read()
  else:
    with pytest.raises(type(error)):
      read()
  late = [RuntimeError("Event loop is closed"), RuntimeError("a late bug"), ValueError("Event loop is closed")]
  for exc_value in late:
    sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc_value), exc_value=exc_value))
  assert reported == (late[1:] if damage else late)


def test_a_damaged_checkpoints_cause_is_one_short_clause(tmp_path):
  """The library's message (TensorStore's can run to many lines of paths) is cut to its first
  line, at most 120 characters."""
  (tmp_path / "2").mkdir()
  long = Exception("DATA_LOSS: Error reading " + "x" * 300 + "\n" + "\n".join(["  at frame"] * 60))
  line = str(preflight.damaged("--step", str(tmp_path), 2, long))
  cause = line[line.index("(") + 1:line.rindex(")")]
  assert "\n" not in line and len(cause) == 120 and cause.startswith("Exception: DATA_LOSS: Error reading xxx")
  assert cause.endswith("…") and line.endswith("no older checkpoint exists: train a new run with python -m train.gpt")
  # train.gpt's own fix names its flag, which train.eval, train.sample and train.export do not have
  assert str(preflight.damaged("--resume --step", str(tmp_path), 2, long)).endswith("start a new --run-dir")
  # train.grpo's --init-from takes a run's latest checkpoint, and no flag picks another
  (tmp_path / "1").mkdir()
  assert str(preflight.damaged(None, str(tmp_path), 2, long)).endswith(
      f"--init-from takes a run's latest checkpoint: move {tmp_path / '2'} out of {tmp_path} to start from step 1")
  # a resumed train.grpo run reads the step it started from, whatever its --step (which picks its own)
  put_back = f"--resume reads the step its run started from: put back an intact copy of {tmp_path / '2'}, or start"
  assert str(preflight.damaged(preflight.RESUMED_START, str(tmp_path), 2, long)).endswith(
      f"{put_back} a new run (another --run-dir, without --resume) from step 1: move {tmp_path / '2'} out of"
      f" {tmp_path} (--init-from takes a run's latest checkpoint)")
  (tmp_path / "1").rmdir()
  assert str(preflight.damaged(preflight.RESUMED_START, str(tmp_path), 2, long)).endswith(
      f"{put_back} a new run (another --run-dir, without --resume) from another --init-from ({tmp_path} has no"
      " older checkpoint)")


def test_an_imported_model_is_checked_on_the_data_ids_and_its_positions(tmp_path, capsys):
  """A Llama of vocabulary 300 takes a FineWeb file of byte ids (the format's usual GPT-2
  tokenizer is no reason to refuse), refuses one that holds id 300, and a --seq-len past its
  64 positions; a Hub id is no folder; a truncated download is one line."""
  pytest.importorskip("transformers")
  from tests.test_data_sft import make_tokenizer
  from tests.test_models_hf import make_hf_model
  from train.store import hf as hf_io

  make_hf_model("llama", tmp_path / "llama", vocab_size=300)
  make_tokenizer(tmp_path / "llama", ["a", "b"])
  bytes_bin, high_bin = tmp_path / "bytes.bin", tmp_path / "high.bin"
  fineweb.write_shard(str(bytes_bin), np.arange(4000) % 257)
  fineweb.write_shard(str(high_bin), np.where(np.arange(4000) == 9, 300, np.arange(4000) % 257))
  flags = ["--init-from", f"hf:{tmp_path / 'llama'}", "--seq-len", "16", "--global-batch-size", "8",
           "--mesh", "fs=1", "--eval-tokens", "0", "--steps", "2"]
  run = gpt._setup([*flags, "--data", f"fineweb:{bytes_bin}", "--run-dir", str(tmp_path / "ok")])
  run.checkpoints.close()
  run.directory.close()
  assert run.model_cfg.vocab_size == 300
  # The run keeps its own copy of the tokenizer: later commands need not find --init-from.
  copy = tmp_path / "ok" / hf_io.RUN_TOKENIZER
  assert (copy / "tokenizer.json").read_bytes() == (tmp_path / "llama" / "tokenizer.json").read_bytes()
  assert hf_io.tokenizer_dir(str(tmp_path / "ok"), "hf:/moved/away") == str(copy)
  truncated = tmp_path / "truncated"  # an interrupted download
  truncated.mkdir()
  for name in ("config.json", "model.safetensors"):
    data = (tmp_path / "llama" / name).read_bytes()
    (truncated / name).write_bytes(data if name == "config.json" else data[:len(data) // 2])
  one = tmp_path / "one.jsonl"
  one.write_text('{"prompt": "a", "completion": "b"}\n')
  capsys.readouterr()
  for argv, message in [
      (["--data", f"sft:{one}"], f"--data sft:{one}: 1 rows of 16 tokens do not fill one global batch of 8;"
                                 " pass more data, or a smaller --global-batch-size or --seq-len"),
      (["--data", f"fineweb:{bytes_bin}", "--init-from", f"hf:{truncated}"],
       f"{truncated / 'model.safetensors'} is not a complete safetensors file ("),
      (["--data", f"fineweb:{high_bin}"], f"--data {high_bin} holds token id 300 but the model's vocabulary"
                                           " has 300 ids (0..299); tokenize the data with --init-from's tokenizer"),
      (["--data", f"fineweb:{bytes_bin}", "--seq-len", "128"], "--seq-len 128 exceeds the 64 positions"),
      (["--init-from", "hf:Qwen3-0.6B"], "Qwen3-0.6B does not exist; hf:DIR is a local folder of config.json"
                                         " and safetensors, or hf:ORG/NAME[@REVISION] a Hugging Face Hub id")]:
    assert gpt.main([*flags, *argv, "--run-dir", str(tmp_path / "refused")]) == 2
    assert message in one_error_line(capsys)
  assert not (tmp_path / "refused").exists()


def test_a_kept_lr_schedule_is_said_in_one_line(capsys):
  """parse kept the saved decay length (tests/test_train_run_config.py); the run says so when
  it starts, with the learning rate of the new steps, and refuses new steps at rate 0."""
  saved = config_lib.Config(steps=2).to_json()
  # cosine from 1e-2 to --min-lr 1e-3 over 2 steps (1 of warmup): step 3 at the end's 1e-3
  kept = config_lib.Config(steps=3, lr_decay_steps=2, lr=1e-2, min_lr=1e-3, resume=True)
  preflight.check_schedule(kept, 2, saved)
  preflight.schedule_warning(kept, saved, 2)
  assert capsys.readouterr().err == ("warning: --resume --steps 3 keeps the run's lr schedule, which decays"
                                     " over 2 steps: steps 3..3 train at learning rate 1.000E-03; pass"
                                     " --lr-decay-steps 3 to stretch it over the new length instead\n")
  # The new steps' rates in their order: rising in warmup (10 steps to 2e-2: step k at 2e-3 k), then
  # through the peak into a linear decay to 0 over steps 11..20 (step 15 at 2e-2 x 6/10)
  for steps, decay, style, rate in [(6, 200, "cosine", "6.000E-03 to 1.200E-02"),
                                    (15, 20, "linear", "6.000E-03 to 1.200E-02 (at most 2.000E-02)")]:
    preflight.schedule_warning(config_lib.Config(steps=steps, lr_decay_steps=decay, lr=2e-2, lr_warmup_steps=10,
                                                 lr_decay_style=style, resume=True), {**saved, "steps": decay}, 2)
    assert f"steps 3..{steps} train at learning rate {rate};" in capsys.readouterr().err
  preflight.schedule_warning(config_lib.Config(steps=3, lr_decay_steps=3), saved, 2)  # stretched
  preflight.schedule_warning(config_lib.Config(steps=3, lr_decay_steps=2), {**saved, "lr_decay_steps": 2}, 2)
  assert capsys.readouterr().err == ""
  with pytest.raises(cli.UsageError, match="steps 3..3 would train at learning rate 0; pass --lr-decay-steps 3"):
    preflight.check_schedule(config_lib.Config(steps=3, lr_decay_steps=2, resume=True), 2, saved)


EDITABLE_INSTALL = """
import importlib.machinery, importlib.util, os, sys
root, argv = sys.argv[1], sys.argv[2:]
class EditableFinder:  # as setuptools' editable finder: on sys.meta_path, asked after the path
  @staticmethod
  def find_spec(name, path=None, target=None):
    if name in ("train", "data", "models", "dion_jax"):
      return importlib.util.spec_from_file_location(
          name, os.path.join(root, name, "__init__.py"), submodule_search_locations=[os.path.join(root, name)])
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != root]
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, EditableFinder)
from train import gpt
sys.exit(gpt.main(argv))
"""


def test_folders_named_like_the_packages_in_the_working_directory_do_not_shadow_them(tmp_path):
  """From a directory with data/ and models/ folders, the trainer imports the real packages
  (it gets as far as checking the data against the model: one line, exit 2)."""
  (tmp_path / "data").mkdir()
  (tmp_path / "models").mkdir()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", EDITABLE_INSTALL, root, *TINY, "--vocab-size", "100",
                        "--run-dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True,
                       env=xla_env.subprocess_env(drop=("PYTHONPATH",)),
                       timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.startswith("error: --data stdlib holds token id 256") and out.stderr.count("\n") == 1


def test_out_of_memory_is_one_line(compile_cache, tmp_path, capsys):  # noqa: F811
  """XLA's RESOURCE_EXHAUSTED at step 3 (raised here as the runtime raises it): one line
  with the step and what lowers memory, exit 1, the lock released."""
  import jax

  run = gpt._setup([*TINY, "--steps", "5", "--run-dir", str(tmp_path / "run"), "--eval-tokens", "0"])
  compiled, calls = run.train_step, []

  def step(state, batch):
    calls.append(1)
    if len(calls) == 3:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00TiB.")
    return compiled(state, batch)

  run.train_step = step
  from train.run import loop

  assert loop.train(run) == 1
  err = one_error_line(capsys)
  assert err.startswith("error: out of device memory by step 3 (RESOURCE_EXHAUSTED: Out of memory while"
                        " trying to allocate 1.00TiB.); no checkpoint was written; lower --micro-batch-size")
  assert not (tmp_path / "run" / rundir.LOCK_NAME).exists()


def test_a_step_larger_than_memory_is_refused_before_anything_is_written(compile_cache, tmp_path, capsys):  # noqa: F811
  """--seq-len 10^6: XLA's memory analysis of the compiled step exceeds the host's free memory; one
  line naming both, exit 2, no run directory. The need is checked against the attention
  probabilities of the one layer, batch 8 x 2 heads x T x T float32 (64 TB): the step stores
  them for the backward pass (about 2x that was reached at 10^7 on the 4-layer preset)."""
  run_dir = tmp_path / "run"
  assert train(run_dir, "--seq-len", "1000000", "--eval-tokens", "0", "--steps", "1") == 2
  err = one_error_line(capsys)
  match = re.match(r"error: a training step needs ([\d,.]+) GiB, more than the [\d.]+ GiB the host has free for this"
                   r" process \(of [\d.]+ GiB\) \(--seq-len 1000000\); lower --seq-len", err)
  assert match, err
  probabilities = 8 * 2 * 1e6 ** 2 * 4 / 2**30
  assert probabilities <= float(match.group(1).replace(",", "")) <= 10 * probabilities, err
  assert not run_dir.exists()
