"""The trainer's step compiled for a mesh, without data or a run directory: the reference the
planner's memory is checked against (``tests/test_train_plan_memory.py``,
``benchmarks/plan_memory.py``, ``python -m train.gpu``'s memory stage).

:func:`compile_step` builds the step ``train.run.setup.setup`` compiles (the same mesh,
parallelism, model configuration, optimizer and jitted step, ``train/run/trainer.py``) from
the trainer's own flags, and compiles it for one global batch of token ids; :func:`footprint`
reads its ``memory_analysis()`` as device and host bytes per device.
"""
from __future__ import annotations

import tempfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from train.plan import planner
from train.run import config as config_lib
from train.run import model_source, setup, trainer


class Footprint(NamedTuple):
  """A compiled program's memory per device (XLA's ``memory_analysis``): ``device`` =
  arguments + outputs - aliased + temporaries in device memory, ``host`` the same in host
  memory; ``temporaries`` the device part that lives only during the step."""
  device: int
  host: int
  temporaries: int
  arguments: int


def footprint(stats) -> Footprint:
  device = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)
  host = (stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes
          + stats.host_temp_size_in_bytes)
  return Footprint(device, host, stats.temp_size_in_bytes, stats.argument_size_in_bytes)


def compile_step(argv: list[str], vocab_size: int = 50257) -> tuple[jax.stages.Compiled, models.GPTConfig]:
  """The trainer's step for ``python -m train.gpt ARGV`` (``--vocab-size`` defaults to
  ``vocab_size``, GPT-2's, the stdlib corpus's), compiled for one global batch, with the
  model's configuration; nothing is trained or written."""
  with tempfile.TemporaryDirectory(prefix="plan_compiled_") as run_dir:
    cfg = config_lib.parse(["--run-dir", run_dir, "--eval-tokens", "0", *argv])
  mesh = setup.make_mesh(cfg.mesh or f"fs={len(jax.devices())}")
  par, accum = trainer.parallelism(cfg, mesh)
  origin = model_source.resolve(cfg.init_from, cfg.preset)
  model_cfg = origin.model_config(cfg, cfg.vocab_size or vocab_size)
  with jax.set_mesh(mesh):
    graphdef, params = models.init(model_cfg, par, cfg.seed)
    state, train_step = trainer.make_trainer(cfg, model_cfg, graphdef, params, par, accum)
    sharding = NamedSharding(mesh, P(models.BATCH_AXES))
    batch = {k: jax.ShapeDtypeStruct((cfg.global_batch_size, model_cfg.seq_len), jnp.int32, sharding=sharding)
             for k in ("inputs", "targets")}
    compiled = train_step.lower(state, batch).compile()
  return compiled, model_cfg


def planned(argv: list[str], vocab_size: int = 50257) -> dict:
  """The planner's memory (``train.plan.memory.memory``) of the step :func:`compile_step`
  compiles for the same flags."""
  with tempfile.TemporaryDirectory(prefix="plan_compiled_") as run_dir:
    cfg = config_lib.parse(["--run-dir", run_dir, "--eval-tokens", "0", *argv])
  model_cfg = model_source.resolve(cfg.init_from, cfg.preset).model_config(cfg, cfg.vocab_size or vocab_size)
  mesh = cfg.mesh or f"fs={len(jax.devices())}"
  return planner.plan(model_cfg, mesh, cfg.optimizer, rank_fraction=cfg.dion_rank_fraction,
                      global_batch=cfg.global_batch_size, micro=cfg.micro_batch_size, dtype=model_cfg.dtype,
                      compare=False, remat=policy_of(cfg), offload_optimizer=getattr(cfg, "offload_optimizer", False),
                      loss_chunk=getattr(model_cfg, "loss_chunk", 0))["memory"]


def policy_of(cfg) -> str:
  """The trainer's recompute policy: ``--remat POLICY``, or today's switch."""
  return cfg.remat if isinstance(cfg.remat, str) else ("full" if cfg.remat else "none")
