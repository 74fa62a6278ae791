"""Ctrl-C and SIGTERM during training: finish the step, save, exit 130 / 143.

As Megatron's ``--exit-signal-handler``: the first SIGINT or SIGTERM only sets
:attr:`Interrupt.signum` and says so in one line; the loop sees it after the current step, saves a checkpoint,
waits for the pending saves and exits with ``128 + signum`` (130, 143). A second signal
runs ``on_second`` (which removes unfinished saves and the run's lock) and exits at
once with the same code: the user asked twice.

With several processes a signal may reach only one of them (a scheduler's SIGTERM to one
host, a Ctrl-C in one terminal), yet all must stop after the same step and save it
together. :class:`Agreement` takes the largest signal number over the processes with one
small all-reduce per step, as Megatron's handler all-gathers its flag every iteration;
it is read a step later, with that step's metrics, so it never stalls the device queue
(the processes then stop one step after the signal, all after the same one).
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
  """Handlers for :data:`SIGNALS` while a ``with`` block runs; the old ones after it."""

  def __init__(self, on_second: Callable[[], None]):
    self.signum: int | None = None
    self._on_second = on_second
    self._previous: dict = {}

  def _handle(self, signum, frame) -> None:
    if self.signum is not None:
      self._on_second()
      os._exit(128 + signum)
    self.signum = signum
    # The steps under way may take minutes (a CPU step of small): say at once that it was heard.
    # os.write, not print: the handler may run inside another write to stderr.
    name = signal.Signals(signum).name
    os.write(2, f"{name}: stopping after the steps under way, saving the last; {name} again exits at once,"
                " without that save\n".encode())

  def __enter__(self) -> Interrupt:
    self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)


class Agreement:
  """The largest of one int per process (a signal number, 0 for none), the same on every
  process. With one process it is the value itself, at once. With several, each call starts the
  all-reduce of this step's value over the run's mesh and returns the previous
  call's result (0 at the first): that result is ready once the step dispatched before it
  has run, so reading it waits no longer than reading that step's metrics.

  The all-reduce takes an output of the step (``after``) that it does not read, so that it
  runs after the step: where the step failed in this process (out of memory), the all-reduce
  fails with the step's error, which reading it raises, instead of starting a collective that
  the other processes, still inside the step's collectives, never match (measured: both
  processes then waited in gloo for good)."""

  def __init__(self, mesh: jax.sharding.Mesh):
    self._pending: jax.Array | int | None = None
    self._mesh = mesh
    # Over the step's own devices: a collective over other ones could run beside the
    # step's (on CPU, gloo then mixed the two).
    self._values = NamedSharding(mesh, P(mesh.axis_names))
    self._max = jax.jit(lambda values, after: jnp.max(values), out_shardings=NamedSharding(mesh, P()),
                        keep_unused=True)

  def __call__(self, value: int, after: jax.Array) -> int:
    if jax.process_count() == 1:
      self._pending = value
      return value
    previous = self.latest()
    local = np.full(sum(d.process_index == jax.process_index() for d in self._mesh.devices.flat), value, np.int32)
    self._pending = self._max(jax.make_array_from_process_local_data(self._values, local, (self._mesh.size,)),
                              after)
    return previous

  def latest(self) -> int:
    """The result of the last call, waiting for it (0 before any)."""
    return 0 if self._pending is None else int(self._pending)
