"""Faults of multi-host runs (``train/run/peers.py``): two processes of ``python -m train.gpt`` on
127.0.0.1 (gloo, one CPU device each, mesh fs=2). A killed or stopped process, a checkpoint write
that fails in one process, a step out of memory in one process, bad input seen by one process:
every other process ends soon after, with one line, the whole checkpoints kept, nothing partial
left, and ``--resume`` (on one process: another process count) continues as a run that never
stopped did (the same loss at the same steps, so the same data order). A signal to one process
stopping every process after the same step is ``tests/test_train_run_faults.py``'s.

The limits of one process (a file size of 0, an address space a little above its size) are set
by a wrapper after one of its saves, as a full quota or a host whose free memory shrank would
set them; what fails is the kernel's refusal, not a stand-in.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.test_train_run_faults import TINY
from tests.test_train_gpt import compile_cache, subprocess_env, train_losses  # noqa: F401  fixture
from train import gpt
from train.store import rundir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="/proc, rlimits")]

HEARTBEAT = 6  # --heartbeat-timeout of these runs, s
# Every run but the out-of-memory one shares two compiled programs (two processes, one process).
ARGS = [*TINY, "--mesh", "fs=2", "--eval-tokens", "0", "--save-every", "2"]
# A vocabulary of 65536 makes the logits of a step 64 MiB, which the out-of-memory test needs;
# its steps take seconds on this CPU (the others' a tenth of one), so only that run has it.
BIG_VOCAB = ["--vocab-size", "65536"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LIMITED = """
import os, resource, signal, sys
from train import gpt
from train.run import loop
limit, argv = sys.argv[1], sys.argv[2:]
save, saves = loop.save, []

def vm_size():
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

def limited_save(run, step, state, examples):
  saves.append(step)
  if limit == "files" and len(saves) == 2:  # this process can write no byte more
    run.checkpoints.manager.wait_until_finished()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
  save(run, step, state, examples)
  if limit == "memory" and len(saves) == 1:  # 16 MiB more for this process
    run.checkpoints.manager.wait_until_finished()
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (16 << 20),) * 2)

loop.save = limited_save
sys.exit(gpt.main(argv))
"""


def launch(run_dir, cache: str, *args: str, limit: str | None = None) -> list[subprocess.Popen]:
  """Processes 0 and 1 of a run on 127.0.0.1, each in a process group of its own (its agent
  and worker, ``train/run/agent.py``), as on two hosts; process 1 under the wrapper's ``limit``."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(2):
    start = ["-c", LIMITED, limit] if limit and i == 1 else ["-m", "train.gpt"]
    procs.append(subprocess.Popen([sys.executable, *start, *ARGS, "--run-dir", str(run_dir), "--steps", "1000",
                                   "--heartbeat-timeout", str(HEARTBEAT), "--coordinator", f"127.0.0.1:{port}",
                                   "--num-processes", "2", "--process-id", str(i), *args],
                                  env=subprocess_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT, start_new_session=True))
  return procs


# The lost-process tests save every SPACED steps and strike once step SPACED + 1 is logged (the
# loop is then a step further): a few steps before the next save, as a process lost while its
# collectives fail ends by the heartbeat's line, one lost during a save by the save's.
SPACED = 5


def wait_for_step(run_dir, step: int, procs, saved: int | None = 2) -> None:
  """Until ``step`` is logged and the checkpoint of step ``saved`` is whole (a process killed
  before then would leave nothing to resume from; None: no checkpoint awaited)."""
  metrics, whole = run_dir / "metrics.jsonl", run_dir / "checkpoints" / str(saved) / "commit_success.txt"
  while not (metrics.exists() and any(json.loads(line)["step"] == step for line in open(metrics) if line.strip())
             and (saved is None or whole.exists())):
    for p in procs:
      assert p.poll() is None, p.communicate()[1][-3000:]
    time.sleep(0.05)


def ends(procs, which=(0, 1)) -> tuple[list[int], list[str], float]:
  """Exit codes and stderr of ``which``, and the seconds until the last of them ended; then
  every process is killed."""
  start = time.monotonic()
  try:
    errs = [procs[i].communicate(timeout=120)[1] for i in which]
  finally:
    for p in procs:
      p.kill()
      p.communicate()
      _wait_until_gone(p.pid)
  return [procs[i].returncode for i in which], errs, time.monotonic() - start


def _wait_until_gone(group: int, timeout: float = 30) -> None:
  """Until no live process is left in process ``group`` (an agent's worker dies after it, by
  PR_SET_PDEATHSIG, and holds the run's lock until then; a zombie counts as gone)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    states = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/stat") as f:
          fields = f.read().rpartition(")")[2].split()
      except OSError:
        continue
      if int(fields[2]) == group:
        states.append(fields[0])
    if all(s == "Z" for s in states):
      return
    time.sleep(0.05)
  raise AssertionError(f"process group {group} still alive after {timeout} s")


def one_line(err: str) -> str:
  assert err.startswith("error: ") and err.count("\n") == 1, err[-3000:]
  return err.strip()


def both_end_with(run_dir, procs, message: str) -> None:
  """Both processes exit 1 with the same line, ``error: `` and the ``message`` pattern, and each
  its own resume command; step 2 is the one checkpoint left, whole, and the lock is released."""
  codes, errs, _ = ends(procs)
  assert codes == [1, 1]
  for i, err in enumerate(errs):
    assert re.fullmatch("error: " + message + resume_command(run_dir, i), one_line(err)), err
  assert errs[0].split("; continue with")[0] == errs[1].split("; continue with")[0]
  assert saved(run_dir) == [2] and not (run_dir / rundir.LOCK_NAME).exists()


def resume_command(run_dir, process: int) -> str:
  return (f"; continue with: python -m train.gpt --run-dir {run_dir} --resume --coordinator 127.0.0.1:\\d+"
          f" --num-processes 2 --process-id {process} --heartbeat-timeout {HEARTBEAT}")


def saved(run_dir) -> list[int]:
  """The checkpoint steps, after checking that nothing partial is left and each is complete."""
  names = os.listdir(run_dir / "checkpoints")
  assert not any(rundir.PARTIAL_MARK in n for n in names), names
  assert all((run_dir / "checkpoints" / n / "commit_success.txt").exists() for n in names), names
  return sorted(int(n) for n in names)


def resumes_as_uninterrupted(run_dir, step: int, reference: dict[int, float], *args: str) -> None:
  """--resume on one process (2 of conftest's 8 devices) continues from checkpoint ``step``
  with the losses of the run that never stopped, within float32 rounding of the two programs
  (3.5e-6 measured; another batch is off by 1e-2 or more)."""
  assert gpt.main(["--run-dir", str(run_dir), "--resume", "--steps", str(step + 2), *args]) == 0
  losses = train_losses(run_dir)
  assert [losses[s] for s in (step + 1, step + 2)] == pytest.approx([reference[s] for s in (step + 1, step + 2)],
                                                                    rel=1e-5)


@pytest.fixture(scope="module")
def reference(compile_cache, tmp_path_factory) -> dict[int, float]:  # noqa: F811
  """The losses of the uninterrupted run, on one process (saved only at its end: the tests
  read its losses)."""
  run_dir = tmp_path_factory.mktemp("reference")
  assert gpt.main([*ARGS, "--run-dir", str(run_dir), "--steps", "12", "--save-every", "0"]) == 0
  return train_losses(run_dir)


def test_a_killed_process_ends_the_other_with_one_line(compile_cache, reference, tmp_path):  # noqa: F811
  """Process 1 killed (SIGKILL) once step 6 is logged: process 0, whose collective fails at
  once, ends when process 1's heartbeat has been missing for --heartbeat-timeout (measured 5.4 s
  at 5 s; before, 80 s and exit 134 with a C++ stack), exit 1, the lock released."""
  run_dir = tmp_path / "run"
  procs = launch(run_dir, compile_cache, "--save-every", str(SPACED))
  wait_for_step(run_dir, SPACED + 1, procs, SPACED)
  procs[1].kill()
  (code,), (err,), seconds = ends(procs, (0,))
  assert code == 1
  step = saved(run_dir)[-1]
  assert re.fullmatch(rf"error: process 1 of 2 stopped answering: nothing heard for [\d.]+ s \(--heartbeat-timeout"
                      rf" {HEARTBEAT}\) after step \d+; the last whole checkpoint is step {step} in"
                      rf" {run_dir / 'checkpoints'}" + resume_command(run_dir, 0), one_line(err))
  assert seconds < HEARTBEAT + 15
  assert not (run_dir / rundir.LOCK_NAME).exists()
  resumes_as_uninterrupted(run_dir, step, reference)


def test_a_hung_coordinator_ends_the_other_with_one_line(compile_cache, reference, tmp_path):  # noqa: F811
  """Process 0, which holds JAX's coordination service, stopped (SIGSTOP, a hung host) once
  step 6 is logged: process 1's requests go unanswered, and it ends after --heartbeat-timeout
  with one line, exit 1, nothing partial left; the lock stays the stopped process's (--resume
  takes it over once that process is gone), and --resume on one process continues as the
  run that never stopped. Process 0 killed with its process group instead (SIGKILL: the
  out-of-memory killer, a lost host; before, process 1's JAX client aborted it: exit 134, 20
  lines of C++, an unfinished save and the lock left) ends process 1 through the same agent
  (``train/run/agent.py``) with one line: tests/test_train_grpo.py's two-process test kills
  train.grpo's process 0 so (dropped here for the suite's time, where it took 19 s of CPU)."""
  run_dir = tmp_path / "run"
  procs = launch(run_dir, compile_cache, "--save-every", str(SPACED))
  wait_for_step(run_dir, SPACED + 1, procs, SPACED)
  os.killpg(procs[0].pid, signal.SIGSTOP)
  (code,), (err,), seconds = ends(procs, (1,))
  assert code == 1
  step = saved(run_dir)[-1]
  assert re.fullmatch(rf"error: process 0 of 2 \(the coordinator\) stopped answering: nothing heard for [\d.]+ s"
                      rf" \(--heartbeat-timeout {HEARTBEAT}\) after step \d+; the last whole checkpoint is step {step}"
                      rf" in {run_dir / 'checkpoints'}" + resume_command(run_dir, 1), one_line(err))
  assert seconds < HEARTBEAT + 15
  assert (run_dir / rundir.LOCK_NAME).exists()
  resumes_as_uninterrupted(run_dir, step, reference)


def test_a_failed_write_in_one_process_ends_both_with_its_line(compile_cache, reference, tmp_path):  # noqa: F811
  """Process 1 can write no byte from its second save on (step 4): its write fails (EFBIG), and
  both processes end with its line at once, exit 1 (before: both waited at Orbax's barriers
  for its timeout, minutes); step 2 stays whole, step 4's partial save is removed."""
  run_dir = tmp_path / "run"
  both_end_with(run_dir, launch(run_dir, compile_cache, limit="files"),
                rf"process 1 of 2: saving the checkpoint of step 4 to {run_dir / 'checkpoints'} failed: File too large"
                r"( \(.*process_1.*\))?; the checkpoint of step 2 is intact; free space or fix permissions there,"
                " then --resume")
  resumes_as_uninterrupted(run_dir, 2, reference)


def test_out_of_memory_in_one_process_ends_both_with_its_line(compile_cache, tmp_path):  # noqa: F811
  """Process 1's address space is held to 16 MiB above its size after its first save (step
  2), and step 3 needs 64 MiB more for its logits: XLA's allocation fails there, and both
  processes end with its line, exit 1 (before: both waited in gloo for good, the failed step's
  process in an all-reduce the other never joined). What it leaves (step 2 whole, nothing
  partial, no lock) is what the failed write leaves, whose test resumes from it."""
  run_dir = tmp_path / "run"
  both_end_with(run_dir, launch(run_dir, compile_cache, *BIG_VOCAB, limit="memory"),
                r"process 1 of 2: out of device memory by step [34] \(.*Out of memory allocating \d+ bytes.*\); the"
                rf" checkpoint of step 2 is in {run_dir / 'checkpoints'}; lower --micro-batch-size or --seq-len, add"
                r" --remat, or shard over more devices \(--mesh\)")


def test_bad_input_seen_by_one_process_ends_both_with_its_line(compile_cache, tmp_path):  # noqa: F811
  """The run directory is in use by another run: only process 0 checks it (exit 2); process 1,
  which went on to compile and to wait in the first step, ends with the same line and exit 2."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / rundir.LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
  codes, errs, _ = ends(launch(run_dir, compile_cache))
  assert codes == [2, 2]
  assert [one_line(e) for e in errs] == [f"error: process 0 of 2: {run_dir} is in use by another run (pid"
                                         f" {os.getpid()} on host {socket.gethostname()},"
                                         f" {run_dir / rundir.LOCK_NAME}); wait for it to end, choose another"
                                         " --run-dir, or delete the lock file if that process is gone"] * 2
  assert sorted(os.listdir(run_dir)) == [rundir.LOCK_NAME]
