"""The agent: each process of a multi-host run is a small parent around a worker that trains,
as torchrun's agent is, so that the death of process 0 ends every survivor with one line.

Why. Process 0 holds JAX's coordination service. When it dies outright (SIGKILL, the kernel's
out-of-memory killer, a lost host), every other process's JAX client finds its long poll for
errors cut and aborts the process at once, in C++, before any Python runs: measured (jax
0.10.2, two ``train.gpt`` processes on 127.0.0.1, process 0's process group killed after step
6), process 1 ended 0.4 s later by SIGABRT (exit 134 from a shell) with 20 lines of C++ log
and stack, leaving step 4's unfinished save and process 0's lock. The client's error callback
cannot be a Python function (``train/run/peers.py``), and jaxlib offers no option to keep
the process alive, so the abort is caught from outside, by the process's parent.

The agent (:func:`supervise`) runs the same command again as its worker, with
:data:`WORKER_ENV` set, and waits for it:

- The worker dies with the agent (``PR_SET_PDEATHSIG``): killing the process the user
  started (its process group, or it alone) kills both, as killing one process did before.
- Its stderr passes through the agent line by line; C++ log records (``W1127 06:17:17...``)
  and what follows them are held for :data:`HOLD_S` seconds, so that the abort's records are
  dropped when the cause is known and no noise (process 0 gone) and shown otherwise.
- Signals: the worker stays in the agent's process group, so a Ctrl-C or a scheduler's
  signal to the group or to every process reaches it directly; one sent to the agent alone
  is forwarded. The worker reports each signal it receives through a pipe (Python's wakeup
  fd, written by the C handler at once, whatever the main thread does); a signal the agent
  received that the worker did not also receive within :data:`SAME_SIGNAL_S` is forwarded,
  so that each reaches the worker once (``train/run/interrupt.py``: a second one exits at
  once).
- When the worker ends with an exit code, or by the user's SIGINT, SIGTERM or SIGHUP, the agent
  ends with the same. A worker whose run ended reports its exit code first (:func:`ended`):
  JAX's shutdown follows, and process 0, which leaves as soon as the shutdown's barrier lets
  it, can take the coordination service away while another process's client still polls it,
  which aborts that process (seen once in CI: process 1 saved, printed its SIGTERM line, then
  aborted). An abort after the report, with the coordinator gone, is that race: the agent ends
  with the reported code, the C++ lines dropped. When the worker is killed or aborts otherwise,
  the agent asks whether process 0's coordination service still answers: if not, it prints
  which process stopped (process 0, the coordinator), the last whole checkpoint and the
  ``--resume`` command; else
  the worker's own end (the signal, its held lines). Either way it removes unfinished saves
  and the run's lock of a process that is gone, and exits 1. After any failed end it removes
  unfinished saves again: the worker's writer threads are gone only once it is.

The agent imports neither JAX nor the model: it costs one small Python process per host.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import BinaryIO

from train.run.config import Config
from train.store import rundir

WORKER_ENV = "DION_JAX_AGENT_FD"  # set in the worker: the pipe it reports its signals to
HOLD_S = 2.0  # how long C++ log records wait: the abort follows its first record within 0.5 s
SAME_SIGNAL_S = 0.5  # a signal the worker also received within this is one signal sent to both
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ENDED = 0  # on the report pipe, where a byte is a signal's number: the exit code comes next
_STOPPED_BY_USER = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_RECORD = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] ")  # absl's log prefix
_PR_SET_PDEATHSIG = 1
EXIT_FAILED = 1
_report_fd: int | None = None  # in a worker: the pipe to its agent


def wanted(cfg: Config) -> bool:
  """Whether this process is the agent of a worker: a multi-host run's process started by
  the user, on Linux (where a child can die with its parent)."""
  multi_host = cfg.coordinator is not None or cfg.distributed
  return multi_host and WORKER_ENV not in os.environ and sys.platform == "linux"


def report_signals() -> None:
  """In a worker, from the main thread: report every signal it receives to the agent."""
  global _report_fd
  fd = os.environ.pop(WORKER_ENV, None)  # the worker's own subprocesses are no workers
  if fd is not None:
    _report_fd = int(fd)
    signal.set_wakeup_fd(_report_fd, warn_on_full_buffer=False)


def ended(code: int) -> int:
  """In a worker whose run ended: tells the agent the exit ``code`` it ends with, before
  JAX's shutdown (module docstring); returns ``code``."""
  if _report_fd is not None:
    with contextlib.suppress(OSError):
      os.write(_report_fd, bytes([_ENDED, code & 0xFF]))  # one write: no signal's byte between
  return code


def resume_command(cfg: Config, command: str) -> str:
  """The ``python -m command`` line that continues ``cfg``'s run on this process (the saved
  flags need not be repeated; a run of several processes names this one's)."""
  words = ["python", "-m", command, "--run-dir", cfg.run_path, "--resume"]
  if cfg.coordinator is None and not cfg.distributed:
    return shlex.join(words)
  if cfg.coordinator is None:
    words.append("--distributed")
  else:
    words += ["--coordinator", cfg.coordinator, "--num-processes", str(cfg.num_processes),
              "--process-id", str(cfg.process_id)]
  for name in ("distributed_timeout", "heartbeat_timeout"):
    if getattr(cfg, name) != getattr(Config, name):
      words += [f"--{name.replace('_', '-')}", str(getattr(cfg, name))]
  return shlex.join(words)


def worker_command(command: str, argv: list[str] | None) -> list[str]:
  """The worker's command line. This process's own when it was started to run ``argv`` (its
  arguments end with them: ``python -m COMMAND ...``, or a script of the user's that passes
  its arguments on to ``main``), so that the worker runs what the user started; else
  ``python -m command argv`` (``main`` called by another program with arguments of its own)."""
  args = sys.argv[1:] if argv is None else list(argv)
  if sys.argv[len(sys.argv) - len(args):] == args:
    return [sys.executable, *sys.orig_argv[1:]]
  return [sys.executable, "-m", command, *args]


def supervise(cfg: Config, command: str, worker_argv: list[str]) -> int:
  """Runs ``worker_argv`` (:func:`worker_command`'s, the command this process was asked
  to run) as the worker and watches it (module docstring); the exit code to end with.
  ``command`` names the command in the ``--resume`` line."""
  reports, report_end = os.pipe()
  os.set_blocking(report_end, False)  # a wakeup fd must not block the handler
  libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

  def die_with_parent():
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before the line above
      os._exit(EXIT_FAILED)

  received = []  # (signal, time) of the signals the agent got
  for s in SIGNALS:
    signal.signal(s, lambda signum, _: received.append((signum, time.monotonic())))
  worker = subprocess.Popen(worker_argv, env={**os.environ, WORKER_ENV: str(report_end)},
                            stderr=subprocess.PIPE, pass_fds=(report_end,), preexec_fn=die_with_parent)
  os.close(report_end)
  relay = Relay(sys.stderr.buffer)
  reported_end = _watch(worker, reports, relay, received)
  code = worker.returncode
  if code < 0 and reported_end is not None and _coordinator_gone(cfg):
    relay.drop()  # the abort of a client whose coordinator left first
    code = reported_end
  if code >= 0 or -code in _STOPPED_BY_USER:
    relay.flush()
    if code != 0:
      # The worker removed its unfinished saves as it ended, but Orbax's writer threads, which
      # wait at barriers and are never joined, could still add to one; now none is alive.
      rundir.remove_partial_saves(cfg.ckpt_path)
    return code if code >= 0 else 128 - code
  return _lost(cfg, command, -code, relay)


def _watch(worker: subprocess.Popen, reports: int, relay: Relay, received: list) -> int | None:
  """Relays the worker's stderr and forwards the signals it did not get, until it ends; the
  exit code the worker reported (:func:`ended`), if it did."""
  reported_end, code_next = None, False
  reported = []  # (signal, time) of the signals the worker got
  forwarded = collections.Counter()  # signals sent to the worker whose report is to come
  streams = [worker.stderr.fileno(), reports]
  while streams or worker.poll() is None:
    ready, _, _ = select.select(streams, [], [], 0.05)
    now = time.monotonic()
    for fd in ready:
      data = os.read(fd, 1 << 16)
      if not data:
        streams.remove(fd)
      elif fd == reports:
        for s in data:
          if code_next:
            reported_end, code_next = s, False
          elif s == _ENDED:
            code_next = True
          elif forwarded[s]:
            forwarded[s] -= 1
          else:
            reported.append((s, now))
      else:
        relay.feed(data)
    for s, t in list(received):
      both = next((r for r in reported if r[0] == s and abs(r[1] - t) <= SAME_SIGNAL_S), None)
      if both is not None:
        reported.remove(both)
        received.remove((s, t))
      elif now - t > SAME_SIGNAL_S and worker.poll() is None:
        worker.send_signal(s)
        forwarded[s] += 1
        received.remove((s, t))
    reported[:] = [r for r in reported if now - r[1] <= SAME_SIGNAL_S]
    relay.release()
  os.close(reports)
  return reported_end


def _lost(cfg: Config, command: str, signum: int, relay: Relay) -> int:
  """The worker was killed or aborted (``signum``): one line naming the process that stopped,
  the clean-up of a process that is gone, exit 1."""
  count = cfg.num_processes or "?"
  coordinator = _coordinator(cfg)
  silent = None if cfg.process_id == 0 or coordinator is None else _unanswered(coordinator)
  if silent is not None:
    relay.drop()  # JAX's abort on the lost coordinator, which the line says
    what = (f"process 0 of {count} (the coordinator) stopped: its coordination service at {coordinator}"
            f" does not answer ({silent}), and JAX ended this process")
  else:
    relay.flush()  # the worker's own end: its last lines say why
    how = ("killed by SIGKILL (the kernel's out-of-memory killer, or a kill)" if signum == signal.SIGKILL
           else f"ended by {signal.Signals(signum).name}")
    what = f"process {cfg.process_id if cfg.process_id is not None else '?'} of {count}: its worker was {how}"
  rundir.remove_partial_saves(cfg.ckpt_path)
  rundir.Lock(cfg.run_path).remove_stale(gone=silent is not None)
  print(f"error: {what}; {rundir.last_whole_checkpoint(cfg.ckpt_path)}; continue with:"
        f" {resume_command(cfg, command)}", file=sys.stderr, flush=True)
  return EXIT_FAILED


def _coordinator(cfg: Config) -> str | None:
  return cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")


def _coordinator_gone(cfg: Config) -> bool:
  """Whether another process's coordination service no longer answers."""
  coordinator = _coordinator(cfg)
  return cfg.process_id != 0 and coordinator is not None and _unanswered(coordinator) is not None


def _unanswered(address: str) -> str | None:
  """Why nothing listens at ``address`` (HOST:PORT), or None when something does."""
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
  except OSError as e:
    return e.strerror or type(e).__name__
  return None


class Relay:
  """The worker's stderr onto ``out``, line by line; a C++ log record and the lines after it
  are held :data:`HOLD_S` seconds (module docstring)."""

  def __init__(self, out: BinaryIO):
    self._out = out
    self._partial = b""  # a line not ended yet
    self._at_start = True  # the next byte starts a line
    self._held: list[bytes] = []
    self._since: float | None = None  # when the held lines began

  def feed(self, data: bytes) -> None:
    lines = (self._partial + data).split(b"\n")
    self._partial = lines.pop()
    for line in lines:
      if self._at_start and self._since is None and _RECORD.match(line):
        self._since = time.monotonic()
      self._write(line + b"\n")
      self._at_start = True
    # A partial line passes at once (a progress bar's "\r" updates) unless it may start a record.
    if self._partial and self._since is None and not (self._at_start and self._partial[:1] in b"IWEF"):
      self._write(self._partial)
      self._partial, self._at_start = b"", False

  def release(self) -> None:
    """Writes the held lines once they waited :data:`HOLD_S` seconds."""
    if self._since is not None and time.monotonic() - self._since > HOLD_S:
      self.flush()

  def flush(self) -> None:
    self._out.write(b"".join(self._held) + self._partial)
    self._out.flush()
    self._at_start = self._at_start and not self._partial
    self._held, self._partial, self._since = [], b"", None

  def drop(self) -> None:
    self._held, self._partial, self._since = [], b"", None

  def _write(self, line: bytes) -> None:
    if self._since is not None:
      self._held.append(line)
    else:
      self._out.write(line)
      self._out.flush()
