"""The run directory: checked before training, held by one run at a time, left whole.

- :func:`check_usable`: ``--run-dir`` / ``--ckpt-dir`` must be (or be creatable as) a
  writable directory, refused before anything is compiled or written (a regular file
  there used to train every step and then hang in Orbax's save threads).
- :class:`Lock`: ``RUN_DIR/run.lock`` holds ``{"host", "pid"}`` of the run that uses
  the directory, created atomically (``O_EXCL``); a second run is refused with the
  holder's host and pid. A lock whose process is gone on this host is stale and taken
  over; one from another host cannot be checked from here and is named for the user
  to remove.
- :func:`remove_partial_saves`: Orbax writes each checkpoint into a ``*.orbax-checkpoint-tmp*``
  directory renamed into place when complete; a failed or interrupted save leaves it
  behind, so every exit path of the trainer removes it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket

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


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
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
        os.remove(self.path)  # stale: its process is gone
        continue
      with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
      self.held = True
      return
    self.check()

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
