"""Ctrl-C and SIGTERM during training: finish the step, save, exit 130 / 143.

As Megatron's ``--exit-signal-handler``: the first SIGINT or SIGTERM only sets
:attr:`Interrupt.signum`; the loop sees it after the current step, saves a checkpoint,
waits for the pending saves and exits with ``128 + signum`` (130, 143). A second signal
runs ``on_second`` (which removes unfinished saves and the run's lock) and exits at
once with the same code: the user asked twice.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
  """Handlers for :data:`SIGNALS` while a ``with`` block runs; the old ones after it."""

  def __init__(self, on_second: Callable[[], None]):
    self.signum: int | None = None
    self._on_second = on_second
    self._previous: dict = {}

  @property
  def exit_code(self) -> int:
    return 128 + self.signum

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name

  def _handle(self, signum, frame) -> None:
    if self.signum is not None:
      self._on_second()
      os._exit(128 + signum)
    self.signum = signum

  def __enter__(self) -> Interrupt:
    self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
