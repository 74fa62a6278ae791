"""The trainer's step compiled for a mesh, without data or a run directory: the memory
XLA assigns it, the reference the planner's memory is checked against
(``tests/test_train_run_plan_memory.py``, ``benchmarks/plan_memory.py``) and what ``python -m
train.gpu``'s memory stage measures on a GPU.

:func:`compile_step` builds the step ``train.run.setup.setup`` compiles (the same mesh,
parallelism, model configuration, optimizer and jitted step, ``train/run/trainer.py``) from
the trainer's own flags, and compiles it for one global batch of token ids; :func:`footprint`
reads its ``memory_analysis()`` as device and host bytes per device.
"""
from __future__ import annotations

import dataclasses
import tempfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
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


class Step(NamedTuple):
  """The trainer's step compiled for a mesh: what :func:`compile_step` returns."""
  compiled: jax.stages.Compiled
  model_cfg: models.GPTConfig
  state: Any  # the trainer's initial state (parameters, optimizer state, ...), on the mesh
  batch: dict  # ShapeDtypeStructs of a global batch of token ids


def compile_step(argv: list[str], vocab_size: int = 50257) -> Step:
  """The trainer's step for ``python -m train.gpt ARGV`` (``--vocab-size`` defaults to
  ``vocab_size``, GPT-2's, the stdlib corpus's), compiled for one global batch; nothing is
  trained or written."""
  cfg, model_cfg = configs(argv, vocab_size)
  mesh = setup.make_mesh(cfg.mesh or f"fs={len(jax.devices())}")
  par, accum = trainer.parallelism(cfg, mesh)
  with jax.set_mesh(mesh):
    graphdef, params = models.init(model_cfg, par, cfg.seed)
    state, train_step = trainer.make_trainer(cfg, model_cfg, graphdef, params, par, accum)
    sharding = NamedSharding(mesh, P(models.BATCH_AXES))
    batch = {k: jax.ShapeDtypeStruct((cfg.global_batch_size, model_cfg.seq_len), jnp.int32, sharding=sharding)
             for k in ("inputs", "targets")}
    compiled = train_step.lower(state, batch).compile()
  return Step(compiled, model_cfg, state, batch)


def configs(argv: list[str], vocab_size: int = 50257) -> tuple[config_lib.Config, models.GPTConfig]:
  """The trainer's configuration of ``argv`` and its model's (``--remat POLICY`` read into
  the model's ``remat``, whatever the trainer's flag takes)."""
  argv, policy = list(argv), None
  if "--remat" in argv:
    at = argv.index("--remat")
    if at + 1 < len(argv) and not argv[at + 1].startswith("--"):
      policy = argv.pop(at + 1)
    argv.pop(at)
    policy = policy or "full"
  with tempfile.TemporaryDirectory(prefix="plan_compiled_") as run_dir:
    cfg = config_lib.parse(["--run-dir", run_dir, "--eval-tokens", "0", *argv])
  model_cfg = model_source.resolve(cfg.init_from, cfg.preset).model_config(cfg, cfg.vocab_size or vocab_size)
  return cfg, dataclasses.replace(model_cfg, remat=policy or "none")
