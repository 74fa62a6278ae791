"""``train.run.preflight.check_memory``: a step that does not fit is refused with the
planner's fastest fix (``train.plan.planner.cheapest_fix``) named, checked against plans
of every choice made here."""
import os
from types import SimpleNamespace

import jax
import pytest

import dion_jax
import models
from train.cli import UsageError
from train.plan import planner
from train.run import config as config_lib
from train.run import preflight

HOST = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _stats(per_device: float):
  return SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0,
                         temp_size_in_bytes=int(per_device))


def test_a_step_over_memory_names_the_fastest_policy_that_fits(tmp_path):
  """tiny at 2,048 tokens on fs=8, compiled (as if) 10% over the host's share of each CPU
  device: the planner's every policy, scaled by need / plan, and the refusal names the
  fastest of those under the limit."""
  cfg = config_lib.parse(["--preset", "tiny", "--mesh", "fs=8", "--global-batch-size", "8", "--run-dir", str(tmp_path)])
  model_cfg = models.preset("tiny", seq_len=2048, vocab_size=2048)
  mesh = dion_jax.make_mesh("fs=8", jax.devices()[:8])
  limit, need = HOST / 8, 1.1 * HOST / 8
  common = dict(optimizer=cfg.optimizer, global_batch=8, dtype=model_cfg.dtype, compare=False)
  scale = need / planner.plan(model_cfg, "fs=8", **common)["memory"]["device_total"]
  fitting = {}
  for policy in planner.remat_policies():
    p = planner.plan(model_cfg, "fs=8", remat=policy, **common)
    if p["memory"]["device_total"] * scale <= limit:
      fitting[policy] = p["time"]["step"]
  assert fitting and "none" not in fitting
  with pytest.raises(UsageError) as refused:
    preflight.check_memory(_stats(need), mesh, model_cfg, cfg)
  message = str(refused.value)
  assert "the planner's fastest step that fits: --remat" in message, message
  named = message.split("--remat ")[1].split()[0]
  assert fitting[named] == min(fitting.values())


def test_without_the_run_s_flags_the_refusal_keeps_its_general_advice():
  mesh = dion_jax.make_mesh("fs=8", jax.devices()[:8])
  with pytest.raises(UsageError, match="lower --seq-len or --micro-batch-size, choose a --remat policy"):
    preflight.check_memory(_stats(2 * HOST), mesh, models.preset("tiny"))
