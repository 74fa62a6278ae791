"""The processes of a multi-host run end together: a lost or hung process, or a fault in one, ends all.

Without this, on jax 0.10.2 (two processes on 127.0.0.1, gloo): when process 1 was killed,
process 0's next collective failed ("Gloo all-reduce failed: ... Connection reset by peer");
when one was stopped (SIGSTOP), the other waited inside a collective. Either way JAX's
coordination service noticed the missing heartbeats only after ``jax.distributed.initialize``'s
``heartbeat_timeout_seconds`` (100 s) and ended every other process with a C++ check failure
(exit 134, a hundred lines of stack). Its error callback (``missed_heartbeat_callback`` of
jaxlib's client) cannot be a Python function: nanobind has no Python type for the
``absl::Status`` it passes, and the process terminates with ``std::bad_cast``.

So the trainer watches its processes itself, through the coordination service's key-value store:

- Heartbeats. A thread of each process writes its counter (``dion_jax/beat/I``) every
  ``min(1 s, T / 10)`` and reads everyone's: a process whose counter has not moved for
  ``--heartbeat-timeout`` T seconds stopped answering. The store lives in process 0; when it
  has not answered for T seconds, process 0 stopped answering.
- Faults. A process that cannot go on (a failed save, out of device memory, bad input, a lost
  peer, an error of its own) writes its one line to ``dion_jax/fault`` (the first one written
  wins); every process reads it within an interval and ends with the same line.
- Ending. Each process runs its clean-up (unfinished saves removed, the run's lock released),
  prints the line and leaves with ``os._exit``: Python's own exit would wait at JAX's shutdown
  barrier for processes that are gone. Process 0 leaves last, once the others said they ended
  (or T passed): its exit takes the store away, which ends the others' JAX clients at once.

JAX's own heartbeat timeout is set to ``2 T + 10`` s, so that its C++ detection, which aborts,
acts only where this watch could not: a client whose coordinator stopped answering aborts half
its timeout and a second later (``T + 6`` s), after this watch's ``T``. The default T is JAX's
own 100 s: the beats come from a Python thread, which a long call holding the interpreter lock
delays, and users found even 100 s short for JAX's C++ heartbeats on hosts busy allocating
pinned memory (jax#23599). A false alarm stops a healthy run; a late one idles the others for a
minute more.

The sudden death of process 0 (SIGKILL, the kernel's out-of-memory killer, a lost host) takes
the coordination service with it, and the other processes' JAX clients abort at once (their
long poll for errors fails) before any Python runs: that end is caught from outside, by the
agent each process runs under (``train/run/agent.py``), which prints the line (process 0
stopped, the last whole checkpoint, the ``--resume`` command), removes unfinished saves and the
dead process's lock, and exits 1.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import NoReturn

import jax
from jax._src import distributed

from train import cli
from train.run import agent
from train.run.config import Config
from train.store import rundir

EXIT_FAILED = 1
KEY = "dion_jax/"
BEAT, DONE, ENDED, FAULT = KEY + "beat/", KEY + "done/", KEY + "ended/", KEY + "fault"
# XLA's runtime errors start with a status code. A collective with a lost peer raises one
# ("UNKNOWN: Gloo all-reduce failed: ... Connection reset by peer") before the peer's
# heartbeat is missed.
_RUNTIME_ERROR = re.compile(r"[A-Z_]+: ")

_peers: Peers | None = None


def jax_heartbeat_timeout(timeout: int) -> int:
  """JAX's heartbeat timeout under ours of ``timeout`` s (the module docstring says why)."""
  return 2 * timeout + 10


def join(cfg: Config) -> None:
  """``jax.distributed.initialize``, cut off after ``--distributed-timeout`` with one line.

  jaxlib aborts the process when processes are missing (a C++ check failure, exit 134,
  "another task died"); a timer a little before its deadline says what happened instead."""

  def give_up():
    print(f"error: multi-host start: not all {cfg.num_processes or ''} processes joined the coordinator"
          f" {cfg.coordinator or '(auto-detected)'} within --distributed-timeout {cfg.distributed_timeout} s;"
          " start every process with the same --coordinator and --num-processes and its own"
          " --process-id, or raise --distributed-timeout", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILED)

  print(f"waiting for {cfg.num_processes or 'all'} processes to join the coordinator"
        f" {cfg.coordinator or '(auto-detected)'} (this is --process-id {cfg.process_id if cfg.process_id is not None else '(auto)'};"
        f" up to --distributed-timeout {cfg.distributed_timeout} s)", flush=True)
  timer = threading.Timer(cfg.distributed_timeout, give_up)
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                               initialization_timeout=cfg.distributed_timeout + 30,
                               heartbeat_timeout_seconds=jax_heartbeat_timeout(cfg.heartbeat_timeout))
  finally:
    timer.cancel()


def watch(cfg: Config, command: str = "train.gpt") -> None:
  """Starts watching the run's processes, after :func:`join` (nothing with one process);
  ``command`` (``python -m COMMAND``) is the one the lines' ``--resume`` command names."""
  global _peers
  if jax.process_count() > 1 and _peers is None:
    _peers = Peers(distributed.global_state.client, cfg, command)
    _peers.start()


def progress(step: int) -> None:
  """Step ``step`` is done here (the lines of a lost peer name the last one)."""
  if _peers is not None:
    _peers.step = step


def fail(message: str, code: int, maybe_lost: bool = False) -> int:
  """Ends the run with ``error: message`` and exit ``code``. With one process the line is
  printed and ``code`` returned, for the caller to return; with several, every process ends
  with the line (preceded by the process that failed) and this never returns. ``maybe_lost``:
  the failure may be a lost peer's doing (a save that failed on no OS error: the step it
  waited on had failed its collective), so the watch's verdict is waited for first, as
  :meth:`Peers.explain` does."""
  if _peers is None:
    print(f"error: {message}", file=sys.stderr)
    return code
  if maybe_lost:
    _peers.await_verdict()
  _peers.end(_peers.own(message), code)


@contextlib.contextmanager
def together(cleanup: Callable[[], None] | None = None, setting_up: bool = False) -> Iterator[None]:
  """A part of the run every process goes through: an error in one process ends them all.

  With several processes, bad input (``cli.BAD_INPUT``) while ``setting_up``, or a
  ``cli.UsageError`` later (a GRPO reward's bad output), ends every process with its line and
  exit 2; any other error with exit 1 (:meth:`Peers.explain`).
  ``cleanup`` runs before a process ends that way. Leaving the block without an error after
  ``setting_up`` tells the others this process is done: its silence while JAX's shutdown
  waits for them is no loss. With one process, nothing."""
  if _peers is None:
    yield
    return
  if cleanup is not None:
    _peers.cleanups.append(cleanup)
  try:
    yield
  except Exception as e:  # noqa: BLE001  every error ends every process
    if isinstance(e, cli.UsageError) or (setting_up and isinstance(e, cli.BAD_INPUT)):
      _peers.end(_peers.own(str(e)), cli.EXIT_USAGE)
    _peers.explain(e)
  if not setting_up:
    _peers.done()


class Peers:
  """The watch of one process (the module docstring): its threads, and how it ends the process."""

  def __init__(self, client, cfg: Config, command: str):
    self.me, self.count = jax.process_index(), jax.process_count()
    self.timeout = cfg.heartbeat_timeout
    self.interval = min(1.0, self.timeout / 10)
    self.cleanups: list[Callable[[], None]] = []
    self.step: int | None = None
    self._client = client
    self._ckpt_path = cfg.ckpt_path
    self._resume = agent.resume_command(cfg, command)
    self._answered = time.monotonic()  # when the store last answered
    self._closing = False  # Python is exiting: the store going away is no fault
    self._ending = threading.Lock()

  def start(self) -> None:
    threading.Thread(target=self._beat, name="peers-beat", daemon=True).start()
    if self.me != 0:  # process 0 holds the store
      threading.Thread(target=self._watch_store, name="peers-store", daemon=True).start()
    atexit.register(self._close)  # runs before JAX's shutdown, registered earlier

  def own(self, message: str) -> str:
    return f"process {self.me} of {self.count}: {message}"

  def done(self) -> None:
    with contextlib.suppress(Exception):
      self._client.key_value_set(f"{DONE}{self.me}", "")

  def await_verdict(self) -> None:
    """Waits long enough for the watch to find a lost peer (which ends the process)."""
    time.sleep(self.timeout + 3 * self.interval)

  def explain(self, error: Exception) -> NoReturn:
    """Ends every process on an error of this one's main thread. A runtime error may be a
    lost peer's doing: the watch's verdict, which ends the process, is waited for first."""
    if _RUNTIME_ERROR.match(str(error)):
      self.await_verdict()
    traceback.print_exception(error)
    first = (str(error).splitlines() or [""])[0][:200]
    self.end(self.own(f"{type(error).__name__}: {first}"), EXIT_FAILED)

  def end(self, line: str, code: int, post: bool = True, lost: frozenset[int] = frozenset(),
          store: bool = True) -> NoReturn:
    """Ends this process with ``error: line`` and ``code``, after posting them for the others
    (``post``: the first fault posted wins) and running the clean-ups; ``lost``: processes
    that will not end with it; ``store``: whether the store still answers."""
    if not self._ending.acquire(blocking=False):
      threading.Event().wait()  # another thread is ending the process
    if post:
      try:
        self._client.key_value_set(FAULT, json.dumps([line, code, sorted(lost)]))
      except Exception:  # noqa: BLE001  another process's fault came first
        with contextlib.suppress(Exception):
          line, code, lost = json.loads(self._client.key_value_try_get(FAULT))
    for cleanup in self.cleanups:
      with contextlib.suppress(Exception):
        cleanup()
    resumable = code == EXIT_FAILED and rundir.existing_steps(self._ckpt_path)
    sys.stdout.flush()
    print(f"error: {line}" + (f"; continue with: {self._resume}" if resumable else ""), file=sys.stderr, flush=True)
    if store and self.me == 0:
      self._wait_for_the_others(set(lost))
    elif store:
      with contextlib.suppress(Exception):
        self._client.key_value_set(f"{ENDED}{self.me}", "")
    os._exit(code)

  def _lost(self, who: str, quiet: float) -> str:
    after = "" if self.step is None else f" after step {self.step}"
    return (f"{who} stopped answering: nothing heard for {quiet:.1f} s"
            f" (--heartbeat-timeout {self.timeout}){after}; {rundir.last_whole_checkpoint(self._ckpt_path)}")

  def _beat(self) -> None:
    beat, seen = 0, {}
    moved = dict.fromkeys(range(self.count), time.monotonic())  # when each one's beat last moved
    while True:
      beat += 1
      try:
        self._client.key_value_set(f"{BEAT}{self.me}", str(beat), allow_overwrite=True)
        entries = dict(self._client.key_value_dir_get(KEY))
      except Exception:  # noqa: BLE001  no answer: _watch_store judges how long that lasts
        if self._closing:
          return
        time.sleep(self.interval)
        continue
      now = self._answered = time.monotonic()
      if FAULT in entries:
        line, code, lost = json.loads(entries[FAULT])
        self.end(line, code, post=False, lost=frozenset(lost))
      for p in range(self.count):
        if p not in seen or entries.get(f"{BEAT}{p}") != seen[p] or f"{DONE}{p}" in entries:
          seen[p], moved[p] = entries.get(f"{BEAT}{p}"), now
        elif now - moved[p] > self.timeout:
          self.end(self._lost(f"process {p} of {self.count}", now - moved[p]), EXIT_FAILED, lost=frozenset({p}))
      time.sleep(self.interval)

  def _watch_store(self) -> None:
    while not self._closing:
      time.sleep(self.interval)
      quiet = time.monotonic() - self._answered
      if quiet > self.timeout and not self._closing:
        self.end(self._lost(f"process 0 of {self.count} (the coordinator)", quiet), EXIT_FAILED,
                 post=False, store=False)

  def _wait_for_the_others(self, lost: set[int]) -> None:
    others = {f"{ENDED}{q}" for q in range(1, self.count) if q not in lost}
    deadline = time.monotonic() + self.timeout
    while others and time.monotonic() < deadline:
      try:
        if others <= {key for key, _ in self._client.key_value_dir_get(ENDED)}:
          return
      except Exception:  # noqa: BLE001  the store is going: nothing to wait for
        return
      time.sleep(0.05)

  def _close(self) -> None:
    self._closing = True
