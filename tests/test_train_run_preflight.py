"""``train.run.preflight.check_memory``: a step that does not fit is refused in one line
that names the memory levers (recompute policy, optimizer offload, the planner's sweep)."""
import dataclasses
import os
from types import SimpleNamespace

import jax
import pytest

import dion_jax
import models
from train.cli import UsageError
from train.run.plan import grpo as plan_grpo
from train.run.plan import model as plan_model
from train.run.plan import planner
from train.run import config as config_lib
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


def test_a_cpu_step_must_fit_what_the_host_has_free(monkeypatch):
  """On CPU the limit is what the process holds and the host has free, not the whole RAM: a step
  of half the RAM, with a quarter free, is refused (the whole RAM let it compile and the kernel
  killed it), and the line says which limit it met."""
  assert 0 < preflight.host_free() < 2 * HOST  # /proc's reading: this process and the available memory
  monkeypatch.setattr(preflight, "host_free", lambda: HOST // 4)
  mesh = dion_jax.make_mesh("fs=1", jax.devices()[:1])
  with pytest.raises(UsageError, match=rf"more than the {HOST / 4 / 2**30:.1f} GiB the host has free for this process"
                                       rf" \(of {HOST / 2**30:.1f} GiB\)"):
    preflight.check_memory(_stats(HOST / 2), mesh, models.preset("tiny"))
  assert preflight.check_memory(_stats(HOST / 8), mesh, models.preset("tiny")) is None


def test_a_step_that_fits_is_not_refused():
  mesh = dion_jax.make_mesh("fs=8", jax.devices()[:8])
  assert preflight.check_memory(_stats(HOST / 64), mesh, models.preset("tiny")) is None  # raises if refused


def _planned(cfg, sizes, remat: str, offload: bool, grpo) -> dict:
  return planner.plan(models.preset("tiny"), sizes, cfg.optimizer, global_batch=cfg.global_batch_size,
                      dtype="float32", compare=False, remat=remat, offload_optimizer=offload, grpo=grpo)


@pytest.mark.parametrize("grpo", [None, plan_grpo.GRPO(prompts=8, group=8, prompt=64, completion=64, beta=0.04)],
                         ids=["train.gpt", "train.grpo"])
def test_a_refused_step_names_the_fastest_policy_and_offload_that_fit_its_mesh(grpo):
  """With the run's flags, the refusal names the fastest choice (by the planner's step time)
  whose planned memory, scaled to the compiled step's, is within the limit; none where none
  is (then the levers, as above). GRPO's update is planned as GRPO's (its sequences, the
  reference policy)."""
  cfg = config_lib.parse(["--preset", "tiny", "--optimizer", "adamw", "--global-batch-size", "64", "--mesh", "fs=8"])
  sizes = dion_jax.parse_mesh_spec("fs=8")
  plans = {(remat, offload): _planned(cfg, sizes, remat, offload, grpo)
           for remat in planner.remat_policies() for offload in (False, True)}
  own = plans["none", False]["memory"]["device_total"]
  least = min(p["memory"]["device_total"] for p in plans.values())
  assert least < 0.8 * own  # the levers matter at this size
  need = 3 * own  # a compiled step three times the plan: every estimate scales by 3
  limit = 3 * (least + own) // 2
  said = preflight.what_fits(cfg, models.preset("tiny"), sizes, need, limit, grpo)
  fits = {choice: p for choice, p in plans.items() if 3 * p["memory"]["device_total"] <= limit}
  remat, offload = min(fits, key=lambda choice: fits[choice]["time"]["step"])
  assert ("none", False) not in fits and said.flags == f"--remat {remat}{' --offload-optimizer' * offload}"
  assert preflight.what_fits(cfg, models.preset("tiny"), sizes, need, 3 * least - 1, grpo) is None


def test_dion_on_the_flagship_mesh_is_told_to_chunk_its_update():
  """docs/planning.md's flagship (GRPO on Llama-3.1-70B, tp=8 x pp=2, 2 prompts x 4 of 256 +
  512 tokens, one H100's 74.5 GiB): Dion at rank 1/16 fits only with its update in chunks,
  so the refusal names --megabatch-mib (beside full recompute and offload), where no
  policy, offload or split of Q fits without it (at the default rank 1/2 nothing fits: its
  r x r factors, 50.3 GiB a device, stay whatever the chunks)."""
  cfg = config_lib.parse(["--optimizer", "dion", "--dion-rank-fraction", "0.0625", "--mesh", "tp=8,pp=2",
                          "--micro-batch-size", "1"])
  model_cfg = plan_model.load_config("70b", None, "bfloat16")
  sizes, limit = dion_jax.parse_mesh_spec("tp=8,pp=2"), int(74.5 * 2**30)
  grpo = plan_grpo.GRPO(prompts=2, group=4, prompt=256, completion=512)
  need = planner.plan_run(cfg, model_cfg, sizes, grpo)["memory"]["device_total"]  # the compiled step, as planned
  unchunked = [planner.plan_run(cfg, model_cfg, sizes, grpo, remat=remat, offload_optimizer=offload, split_q=split)
               for remat in planner.remat_policies() for offload in (False, True) for split in (False, True)]
  assert min(p["memory"]["device_total"] for p in unchunked) > limit
  said = preflight.what_fits(cfg, model_cfg, sizes, need, limit, grpo)
  assert said is not None and said.flags.endswith(f"--megabatch-mib {planner.MEGABATCH_MIB}"), said
  assert said.estimate <= limit


def test_bfloat16_experts_on_a_cpu_mesh_are_refused_in_one_line():
  """XLA:CPU's compiler aborts the process (SIGABRT, a C++ stack) on the experts' bfloat16
  all-reduces (jax 0.10.2, tiny-moe on fs=2, rp=2, ep=2, tp=2): refused before the model is
  built; float32, float16, one device and a dense model compile and are let through."""
  cfg = config_lib.Config(mesh="fs=2")
  moe, dense = models.preset("tiny-moe"), models.preset("tiny")
  two, one = dion_jax.make_mesh("fs=2", jax.devices()[:2]), dion_jax.make_mesh("fs=1", jax.devices()[:1])
  with pytest.raises(UsageError, match=r"^--dtype bfloat16 with experts on a mesh of CPU devices \(--mesh fs=2\)"
                                       r" aborts XLA:CPU's compiler .*; use --dtype float32"):
    preflight.check_model(cfg, dataclasses.replace(moe, dtype="bfloat16"), two)
  for model_cfg, mesh in ((dataclasses.replace(moe, dtype="float32"), two), (dataclasses.replace(moe, dtype="float16"), two),
                          (dataclasses.replace(moe, dtype="bfloat16"), one), (dataclasses.replace(dense, dtype="bfloat16"), two)):
    preflight.check_model(cfg, model_cfg, mesh)
