"""Profiles of chosen training steps: ``--profile-steps A:B``.

:class:`Steps` traces steps A to B (inclusive) with ``jax.profiler`` into
``RUN_DIR/profile`` (``RUN_DIR/profile/process-I`` on several processes): an XSpace
(``plugins/profile/<time>/<host>.xplane.pb``) for TensorBoard's profile plugin
(``pip install tensorboard-plugin-profile``; ``tensorboard --logdir RUN_DIR/profile``)
and ``perfetto_trace.json.gz`` beside it for https://ui.perfetto.dev. Each traced step
is a ``jax.profiler.StepTraceAnnotation`` named ``train`` with its ``step_num``, which
the profile plugin's step view reads. The trace stops once step B's results are
ready, so the device's work of every chosen step is in it. ``train.gpu``'s profile
stage takes its trace through the same flag. (``train.run.config.Config.profile_range``
reads the flag.)
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax

STEP_NAME = "train"


def directory(run_path: str) -> str:
  """Where the run's traces go."""
  if jax.process_count() == 1:
    return os.path.join(run_path, "profile")
  return os.path.join(run_path, "profile", f"process-{jax.process_index()}")


class Steps:
  """Traces ``steps`` = (A, B) of a run into ``trace_dir``; nothing when ``steps`` is None.

  Around each step: ``with profile.step(step): ...`` then ``profile.after(step, state)``;
  :meth:`close` ends a trace that a stopped run left open."""

  def __init__(self, steps: tuple[int, int] | None, trace_dir: str):
    self.steps, self.trace_dir = steps, trace_dir
    self.tracing = False

  @contextlib.contextmanager
  def step(self, step: int) -> Iterator[None]:
    if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
      yield
      return
    if not self.tracing:  # step A, or the first step of a run resumed past it
      jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True)
      self.tracing = True
    with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step):
      yield

  def after(self, step: int, outputs: Any) -> None:
    """Ends the trace after step B, once ``outputs`` (the step's results) are computed."""
    if self.tracing and step == self.steps[1]:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    if self.tracing:
      self.tracing = False
      jax.profiler.stop_trace()
