"""A run's directory, kept alike by ``python -m train.gpt`` and ``python -m train.grpo``:

    RUN_DIR/config.json     the run's flags ("train"; GRPO's own under "grpo") and its model ("model")
    RUN_DIR/metrics.jsonl   one strict-JSON record a line (:class:`MetricsFile`)
    RUN_DIR/checkpoints/    Orbax checkpoints (``train/store/checkpoint.py``; or ``--ckpt-dir``)
    RUN_DIR/run.lock        ``{"host", "pid"}`` of the run using the directory

:class:`RunDirectory` is its life: :meth:`~RunDirectory.check` refuses, before anything is
compiled or written, a directory that is a file or not writable, in use by another run,
holding a run when none is resumed or none when one is (each a ``UsageError`` of one line
that names the fix); :meth:`~RunDirectory.open` takes it once set-up has passed (the lock,
the checkpoint directory, config.json); :meth:`~RunDirectory.close` leaves it whole on every
exit (no unfinished save, no lock). :func:`resumed` gives a resumed run's flags: the saved
ones, with those given again in their place where the command lets them change.

- The lock (:class:`Lock`) is created atomically (``O_EXCL``); a second run is refused
  with the holder's host and pid. A lock whose process is gone on this host is stale
  and taken over; one from another host cannot be checked from here and is named for
  the user to remove.
- Orbax writes each checkpoint into a ``*.orbax-checkpoint-tmp*`` directory renamed into
  place when complete; a failed or interrupted save leaves it behind, so every exit path
  removes it (:func:`remove_partial_saves`).

Nothing here imports jax: ``train/run/config.py`` reads saved flags before JAX starts.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Sequence

from train.cli import UsageError

LOCK_NAME = "run.lock"
PARTIAL_MARK = ".orbax-checkpoint-tmp"


def check_usable(path: str, flag: str) -> None:
  """Raises UsageError unless ``path`` is a writable directory or can be created as one."""
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    what = "is a file" if existing == path else f"lies under the file {existing}"
    raise UsageError(f"{flag} {path} {what}, not a directory; choose a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise UsageError(f"{flag} {path}: {existing} is not writable; choose a writable directory")


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")


def check_run(path: str, name: str = "run directory", runs: str = "python -m train.gpt", alternative: str = "") -> None:
  """Raises UsageError unless ``path`` is a run's directory: one that exists, is a folder,
  and holds a run's config.json, metrics.jsonl or checkpoints/ (``name``: how the message
  calls it, e.g. ``--init-from``; ``runs``: the commands whose runs it takes;
  ``alternative``: what else it takes, e.g. ``, or hf:DIR ...``)."""
  fix = f"name the directory of a {runs} run (by default runs/PRESET-OPTIMIZER, e.g. runs/tiny-dion){alternative}"
  if not os.path.exists(path):
    raise UsageError(f"{name} {path} does not exist; {fix}")
  if not os.path.isdir(path):
    raise UsageError(f"{name} {path} is a file, not a run directory; {fix}")
  if not any(os.path.exists(os.path.join(path, f)) for f in RUN_FILES):
    raise UsageError(f"{name} {path} holds no run (no {', '.join(RUN_FILES)}); {fix}")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
  try:  # a killed process whose parent died too stays a zombie until it is reaped
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except (OSError, IndexError):
    return True


class Lock:
  """``run_path/run.lock`` for this process (see the module docstring)."""

  def __init__(self, run_path: str):
    self.path = os.path.join(run_path, LOCK_NAME)
    self.held = False

  def holder(self) -> dict | None:
    """The live holder's ``{"host", "pid"}``, or None when the directory is free or the
    lock is stale."""
    try:
      with open(self.path) as f:
        holder = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      holder = {"host": "?", "pid": -1}
    if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", -1))):
      return None
    return holder

  def check(self) -> None:
    """Raises UsageError if another live run holds the directory."""
    holder = self.holder()
    if holder is not None:
      raise UsageError(f"{os.path.dirname(self.path)} is in use by another run (pid {holder.get('pid')}"
                       f" on host {holder.get('host')}, {self.path}); wait for it to end, choose"
                       " another --run-dir, or delete the lock file if that process is gone")

  def acquire(self) -> None:
    """Takes the lock (replacing a stale one); raises UsageError if another run holds it."""
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        self.check()
        print(f"warning: taking over {self.path}, left by a run that is gone", file=sys.stderr)
        os.remove(self.path)  # stale: its process is gone
        continue
      with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
      self.held = True
      return
    self.check()

  def remove_stale(self, gone: bool = False) -> None:
    """Removes the lock of a process that is gone: one of this host that is not alive or,
    when the caller saw the lock's writer vanish (``gone``: the run's process 0), one of another
    host; a killed process of this host takes a moment to end, waited for up to 5 s."""
    holder, deadline = self.holder(), time.monotonic() + 5
    while gone and holder is not None and holder.get("host") == socket.gethostname() and time.monotonic() < deadline:
      time.sleep(0.1)
      holder = self.holder()
    if holder is None or (gone and holder.get("host") != socket.gethostname()):
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass

  def release(self) -> None:
    if self.held:
      self.held = False
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass


def remove_partial_saves(ckpt_path: str) -> None:
  """Deletes the unfinished saves Orbax left in ``ckpt_path``."""
  if not os.path.isdir(ckpt_path):
    return
  for name in os.listdir(ckpt_path):
    if PARTIAL_MARK in name:
      shutil.rmtree(os.path.join(ckpt_path, name), ignore_errors=True)


def existing_steps(ckpt_path: str) -> list[int]:
  """Complete checkpoint steps in ``ckpt_path`` without creating it (none if it is missing)."""
  if not os.path.isdir(ckpt_path):
    return []
  return [int(n) for n in os.listdir(ckpt_path) if n.isdigit()]


def last_whole_checkpoint(ckpt_path: str) -> str:
  """Where a run that stopped can continue from, in words."""
  steps = existing_steps(ckpt_path)
  return (f"the last whole checkpoint is step {max(steps)} in {ckpt_path}" if steps
          else f"no checkpoint is saved in {ckpt_path}")


def checkpoint_record(ckpt_path: str, step: int | None = None) -> dict | None:
  """The config record (``{"train", "model", ...}``) saved with checkpoint ``step`` of
  ``ckpt_path``, or with the newest checkpoint that holds a readable one; None if none does.
  Read as the JSON file Orbax's ``JsonCheckpointHandler`` wrote, without importing jax."""
  steps = [step] if step is not None else sorted(existing_steps(ckpt_path), reverse=True)
  for s in steps:
    try:
      with open(os.path.join(ckpt_path, str(s), "config", "metadata")) as f:
        record = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(record, dict) and isinstance(record.get("train"), dict):
      return record
  return None


def saved_record(run_path: str, ckpt_path: str | None = None) -> dict | None:
  """The record of ``run_path/config.json``, or, when it is missing or damaged, of the
  newest checkpoint in ``ckpt_path`` (default RUN_PATH/checkpoints); None when neither
  exists. A damaged config.json without a checkpoint to stand in is a UsageError."""
  path = os.path.join(run_path, "config.json")
  try:
    with open(path) as f:
      record = json.load(f)
  except (FileNotFoundError, NotADirectoryError):  # no run yet (train.gpt names a bad --run-dir)
    record = None
  except (OSError, ValueError):
    record = {}
  if isinstance(record, dict) and isinstance(record.get("train"), dict):
    return record
  stand_in = checkpoint_record(ckpt_path or os.path.join(run_path, "checkpoints"))
  if stand_in is None and record is not None:
    raise UsageError(f"{path} is damaged (no \"train\" record) and no checkpoint holds the run's"
                     " config; restore the file from a backup or start a new --run-dir")
  return stand_in


def flag_name(field: str) -> str:
  return "--" + field.replace("_", "-")


def resumed(saved: dict, given: dict, fixed: Iterable[str], why: str) -> dict:
  """A resumed run's flags: the ``saved`` ones, with the ``given`` ones (those on the
  command line) in their place; a given flag of ``fixed`` that differs from the saved one
  is refused, ``why`` saying what keeps it."""
  for key in fixed:
    if key in given and key in saved and saved[key] != given[key]:
      raise UsageError(f"--resume {flag_name(key)} {given[key]}: the run was saved with {saved[key]}, and {why};"
                       f" resume with {flag_name(key)} {saved[key]} (or without the flag) or start a new --run-dir")
  return {**saved, **given}


def json_line(record: dict) -> str:
  """``record`` as one line of strict JSON, a non-finite float written as null."""
  finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
  return json.dumps(finite, allow_nan=False) + "\n"


class MetricsFile:
  """``RUN_DIR/metrics.jsonl``, appended to: one JSON object a line (:func:`json_line`: a
  non-finite number is written as ``null``, since bare ``NaN`` is not JSON and strict
  readers, ``jq`` among them, reject it), flushed at once; each record also goes to the
  run's ``trackers`` (``train.store.tracking.start``'s: TensorBoard, W&B)."""

  def __init__(self, run_path: str, trackers: Sequence = ()):
    self._file = open(os.path.join(run_path, "metrics.jsonl"), "a")
    self.trackers = trackers

  def write(self, record: dict) -> None:
    self._file.write(json_line(record))
    self._file.flush()
    for tracker in self.trackers:
      tracker.log(record)

  def close(self) -> None:
    self._file.close()
    for tracker in self.trackers:
      tracker.close()


class RunDirectory:
  """A run's directory and its checkpoint directory (module docstring)."""

  def __init__(self, run_path: str, ckpt_path: str | None = None):
    self.path = os.path.abspath(run_path)
    self.ckpt_path = os.path.abspath(ckpt_path or os.path.join(self.path, "checkpoints"))
    self.lock = Lock(self.path)

  def existing_steps(self) -> list[int]:
    return existing_steps(self.ckpt_path)

  def check(self, resume: bool, step: int | None, steps: int, primary: bool = True) -> int:
    """The step the run starts after: 0, or with ``resume`` the checkpoint ``step`` (None:
    the latest); raises UsageError for a directory the run cannot use (module docstring;
    whether it is writable and free checked by the ``primary`` process only, the one that
    writes) or a checkpoint already at ``steps``."""
    if primary:
      check_usable(self.path, "--run-dir")
      check_usable(self.ckpt_path, "--ckpt-dir")
      self.lock.check()
    existing = self.existing_steps()
    if resume and not os.path.isdir(self.ckpt_path):
      raise UsageError(f"--resume: the checkpoint directory {self.ckpt_path} does not exist; check"
                       " --run-dir, or drop --resume to start a new run")
    if resume and not existing:
      raise UsageError(f"--resume: {self.ckpt_path} holds no complete checkpoint; drop --resume to start"
                       " a new run")
    if not resume and existing:
      raise UsageError(f"{self.ckpt_path} already holds checkpoints (latest step {max(existing)}); pass"
                       " --resume to continue that run, or another --run-dir for a new one")
    # A run killed before its first save left a log: appending to it would mix two runs.
    metrics = os.path.join(self.path, "metrics.jsonl")
    if not resume and os.path.exists(metrics) and os.path.getsize(metrics):
      raise UsageError(f"{self.path} already holds a run's metrics.jsonl but no checkpoint; choose a"
                       " new --run-dir, or delete the old run directory")
    if not resume:
      return 0
    if step is not None and step not in existing:
      raise UsageError(f"--step {step}: {self.ckpt_path} has checkpoints at steps"
                       f" {', '.join(map(str, sorted(existing)))}; pass one of them")
    start = max(existing) if step is None else step
    if start >= steps:
      raise UsageError(f"--resume: the run is complete, its checkpoint at step {start} reaches --steps"
                       f" {steps}; to train it further pass a larger --steps with --lr-decay-steps as large"
                       f" (e.g. --steps {2 * start} --lr-decay-steps {2 * start}), which stretches the lr"
                       " schedule over the new length")
    return start

  def open(self, record: dict, start_step: int) -> bool:
    """Takes the directory for this run: the lock, the checkpoint directory, config.json
    with ``record``; deletes the checkpoints after ``start_step`` (a ``--step`` back),
    saying so. Whether it deleted any (the caller's checkpoint manager then reloads)."""
    self.lock.acquire()
    os.makedirs(self.ckpt_path, exist_ok=True)
    newer = sorted(s for s in self.existing_steps() if s > start_step)
    if newer:
      print(f"warning: --step {start_step}: deleting the newer checkpoints of steps"
            f" {', '.join(map(str, newer))}", file=sys.stderr)
      for s in newer:
        shutil.rmtree(os.path.join(self.ckpt_path, str(s)))
    self.write_config(record)
    return bool(newer)

  def write_config(self, record: dict) -> None:
    with open(os.path.join(self.path, "config.json"), "w") as f:
      json.dump(record, f, indent=2)

  def metrics(self, trackers: Sequence = ()) -> MetricsFile:
    return MetricsFile(self.path, trackers)

  def close(self) -> None:
    """Leaves the directory whole: no unfinished save, no lock."""
    remove_partial_saves(self.ckpt_path)
    self.lock.release()
