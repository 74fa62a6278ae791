"""The agent around each process of a multi-host run (``train/run/agent.py``), with a stand-in
worker that starts no JAX: signals reach the worker once whichever way they are sent, an
exit code passes through, an abort after the coordinator is gone becomes one line with the
run's directory cleaned, and a worker's own crash keeps its lines. The real abort (JAX's, on
a killed process 0) is ``tests/test_train_run_peers.py``'s and ``tests/test_train_grpo.py``'s.
"""
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from train.run import agent
from train.store import rundir

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the agent is Linux's (PR_SET_PDEATHSIG)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A command that is its own worker: the agent runs this file again with agent.WORKER_ENV set.
WORKER = """
import os, signal, sys, time
from train.run import agent
from train.run.config import Config
address, process, run_dir, act = sys.argv[1:]
cfg = Config(coordinator=address, num_processes=2, process_id=int(process), run_dir=run_dir)
if agent.wanted(cfg):
  sys.exit(agent.supervise(cfg, "train.gpt", [sys.executable, *sys.orig_argv[1:]]))
agent.report_signals()
got = []
signal.signal(signal.SIGTERM, lambda signum, _: got.append(signum))
print("working", file=sys.stderr, flush=True)
print("ready", flush=True)
if act == "signals":
  deadline = time.monotonic() + 3
  while time.monotonic() < deadline:
    time.sleep(0.01)
  print(got, flush=True)
elif act == "exit 3":
  sys.exit(3)
else:  # a C++ abort as JAX's client writes it, then the abort ("ended N": once its run ended with N)
  if act.startswith("ended "):
    agent.ended(int(act.split()[1]))
  print("F1127 06:17:17.570040   17386 client.h:80] Terminating process because the JAX distributed service"
        " detected fatal errors.", file=sys.stderr)
  print("*** Check failure stack trace: ***\\n    @     0x7f9750840634  absl::log_internal::LogMessage::SendToLog()",
        file=sys.stderr, flush=True)
  os.abort()
"""


def silent_address() -> str:
  """HOST:PORT where nothing listens: a coordinator that is gone."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}"


def start(run_dir, act: str, process: int = 1, address: str | None = None) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", WORKER, address or silent_address(), str(process), str(run_dir), act],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
  assert proc.stdout.readline() == "ready\n"
  return proc


@pytest.mark.parametrize("route", ["the agent alone", "its process group"])
def test_a_signal_reaches_the_worker_once(tmp_path, route):
  """SIGTERM to the agent alone is forwarded; to the group (the agent and the worker, as a
  terminal's Ctrl-C or a scheduler's signal to every process) it is not: the worker gets it once."""
  proc = start(tmp_path, "signals")
  (os.kill if route == "the agent alone" else os.killpg)(proc.pid, signal.SIGTERM)
  out, err = proc.communicate(timeout=30)
  assert (proc.returncode, out, err) == (0, f"[{signal.SIGTERM.value}]\n", "working\n")


def test_an_exit_code_passes_through(tmp_path):
  proc = start(tmp_path, "exit 3")
  assert (proc.wait(timeout=30), proc.stderr.read()) == (3, "working\n")


def dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_an_abort_once_the_coordinator_is_gone_is_one_line(tmp_path):
  """Process 1's worker aborts as JAX's client does when process 0 dies, and nothing listens at
  the coordinator's address any more: its C++ lines give way to one line naming process 0, the
  last whole checkpoint and the --resume command (exit 1); the unfinished save is removed, and
  the lock of the dead process 0 released."""
  (tmp_path / "checkpoints" / "2").mkdir(parents=True)
  (tmp_path / "checkpoints" / f"4{rundir.PARTIAL_MARK}").mkdir()
  (tmp_path / rundir.LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid()}))
  address = silent_address()
  proc = start(tmp_path, "abort", address=address)
  assert proc.wait(timeout=30) == agent.EXIT_FAILED
  assert proc.stderr.read() == (
      f"working\nerror: process 0 of 2 (the coordinator) stopped: its coordination service at {address} does not"
      f" answer (Connection refused), and JAX ended this process; the last whole checkpoint is step 2 in"
      f" {tmp_path / 'checkpoints'}; continue with: python -m train.gpt --run-dir {tmp_path} --resume --coordinator"
      f" {address} --num-processes 2 --process-id 1\n")
  assert sorted(os.listdir(tmp_path)) == ["checkpoints"] and os.listdir(tmp_path / "checkpoints") == ["2"]


def test_an_abort_after_the_run_ended_ends_with_the_runs_code(tmp_path):
  """The race of JAX's shutdown: process 1's run ended (exit 143, its SIGTERM line printed),
  then its client aborts, process 0's coordination service gone. The run's code stands, the
  C++ lines dropped; process 0's lock and the saves are left as they are."""
  (tmp_path / "checkpoints" / "13").mkdir(parents=True)
  (tmp_path / rundir.LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid()}))
  proc = start(tmp_path, "ended 143")
  assert (proc.wait(timeout=30), proc.stderr.read()) == (143, "working\n")
  assert sorted(os.listdir(tmp_path)) == ["checkpoints", rundir.LOCK_NAME]


def test_a_crash_of_its_own_keeps_its_lines(tmp_path):
  """Process 0's worker aborts (its coordinator is its own): its last lines are shown, then
  the line, exit 1; a live process's lock stays."""
  (tmp_path / rundir.LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
  proc = start(tmp_path, "abort", process=0)
  assert proc.wait(timeout=30) == agent.EXIT_FAILED
  lines = proc.stderr.read().splitlines()
  assert lines[1].startswith("F1127 ") and lines[3].startswith("    @ ")
  assert re.fullmatch(r"error: process 0 of 2: its worker was ended by SIGABRT; no checkpoint is saved in .*;"
                      r" continue with: python -m train.gpt .* --process-id 0", lines[-1]), lines
  assert (tmp_path / rundir.LOCK_NAME).exists()


def test_the_relay_holds_cpp_records_until_they_are_old(monkeypatch):
  """A C++ log record and the lines after it wait HOLD_S seconds, then pass in order; a
  progress bar's partial line passes at once; dropped records never appear."""
  clock = [0.0]
  monkeypatch.setattr(time, "monotonic", lambda: clock[0])
  out = io.BytesIO()
  relay = agent.Relay(out)
  relay.feed(b"step 1\n\rloading 50%")
  assert out.getvalue() == b"step 1\n\rloading 50%"
  relay.feed(b"\nW1127 06:17:17.569938   17386 preemption_sync_manager.cc:147] Failed\nmore\nstep 2\n")
  clock[0] = agent.HOLD_S / 2
  relay.release()
  assert out.getvalue() == b"step 1\n\rloading 50%\n"
  clock[0] = agent.HOLD_S * 1.5
  relay.release()
  assert out.getvalue().endswith(b"\nW1127 06:17:17.569938   17386 preemption_sync_manager.cc:147] Failed\nmore\nstep 2\n")
  relay.feed(b"E1127 06:17:18.000001   17386 coordination_service_agent.cc:289] Polled an error\nF")
  relay.drop()
  relay.flush()
  assert out.getvalue().endswith(b"step 2\n")


@pytest.mark.parametrize("orig_argv, argv_, argv, expected", [
    # python -m train.gpt ARGS: the worker runs the same command line
    (["python", "-m", "train.gpt", "--coordinator", "h:1"], ["train/gpt.py", "--coordinator", "h:1"], None,
     ["-m", "train.gpt", "--coordinator", "h:1"]),
    # a user's script passing its arguments on to main: the worker runs the script
    (["python", "wrap.py", "x", "--coordinator", "h:1"], ["wrap.py", "x", "--coordinator", "h:1"],
     ["--coordinator", "h:1"], ["wrap.py", "x", "--coordinator", "h:1"]),
    # main called by another program with arguments of its own: python -m COMMAND ARGV
    (["python", "-m", "pytest", "-q"], ["pytest", "-q"], ["--coordinator", "h:1"],
     ["-m", "train.gpt", "--coordinator", "h:1"]),
])
def test_the_worker_runs_what_the_user_started(monkeypatch, orig_argv, argv_, argv, expected):
  """``argv_`` is the process's ``sys.argv``, ``argv`` what ``main`` was called with."""
  monkeypatch.setattr(sys, "orig_argv", orig_argv)
  monkeypatch.setattr(sys, "argv", argv_)
  assert agent.worker_command("train.gpt", argv) == [sys.executable, *expected]
