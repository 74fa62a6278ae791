"""What the command lines of ``train/`` share: bad input ends them with one line and exit code 2.

A user who mistypes a flag or points at a missing run needs the fix, not a traceback;
a failure after start-up is a bug or a failed run and keeps its traceback. Nothing
here imports jax (``train/run/config.py`` must not).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + 2  # SIGINT's number, as a shell reports a Ctrl-C
T = TypeVar("T")
# Set when run() caught a Ctrl-C: the program it interrupted may still be compiling.
_caught_interrupt = False
# What a bad flag, file or setting raises while a command starts.
BAD_INPUT = (ValueError, FileNotFoundError)  # UsageError is a ValueError


class UsageError(ValueError):
  """Bad input the user can fix: printed as one ``error: ...`` line, exit code 2."""


class Parser(argparse.ArgumentParser):
  """Raises UsageError (pointing at ``PROG --help``) where argparse would print usage and exit."""

  def error(self, message):
    raise UsageError(f"{message} (see {self.prog} --help)")


def run(start: Callable[[], T], then: Callable[[T], int] = lambda _: 0, *, interrupted: str | None = None,
        read_only: bool = False) -> int:
  """``then(start())``; bad input raised by ``start`` prints ``error: ...`` and returns EXIT_USAGE.

  Only ``start`` (flags, input checks, set-up) is guarded: a ValueError while ``then``
  works is no usage error. With ``interrupted`` (what a Ctrl-C during ``start`` left
  behind), a Ctrl-C there prints ``error: INTERRUPTED`` and returns EXIT_INTERRUPTED; a
  ``read_only`` command (it writes nothing, or only atomically in ``start``) says so of a
  Ctrl-C during ``then`` too.
  """
  try:
    value = start()
  except BAD_INPUT as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    if interrupted is None:
      raise
    return _interrupted(interrupted)
  try:
    return then(value)
  except KeyboardInterrupt:
    if not read_only or interrupted is None:
      raise
    return _interrupted(interrupted)


def _interrupted(what: str) -> int:
  global _caught_interrupt
  _caught_interrupt = True
  print(f"error: {what}", file=sys.stderr)
  return EXIT_INTERRUPTED


def exit(code: int) -> None:
  """Ends the process with ``code``; after a Ctrl-C that :func:`run` caught, without the
  interpreter's teardown, which crashes (exit 139) while XLA still compiles the program the
  Ctrl-C interrupted."""
  if _caught_interrupt:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
