"""``train.run.preflight.check_memory``: a step that does not fit is refused in one line
that names the memory levers (recompute policy, optimizer offload, the planner's sweep)."""
import os
from types import SimpleNamespace

import jax
import pytest

import dion_jax
import models
from train.cli import UsageError
from train.run import preflight

HOST = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _stats(per_device: float):
  return SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0,
                         temp_size_in_bytes=int(per_device))


def test_a_step_over_memory_names_the_levers_that_would_fit_it():
  mesh = dion_jax.make_mesh("fs=8", jax.devices()[:8])
  with pytest.raises(UsageError) as refused:
    preflight.check_memory(_stats(2 * HOST / 8), mesh, models.preset("tiny"))
  message = str(refused.value)
  assert "\n" not in message
  for lever in ("--remat", "--offload-optimizer", "python -m train.plan --sweep"):
    assert lever in message, message


def test_a_step_that_fits_is_not_refused():
  mesh = dion_jax.make_mesh("fs=8", jax.devices()[:8])
  assert preflight.check_memory(_stats(HOST / 64), mesh, models.preset("tiny")) is None  # raises if refused
