"""A trained model restored for use after training: by ``python -m train.sample``,
``train.eval``, ``train.export`` and ``train.grpo`` (its starting policy).

:func:`restore` reads the parameters of a run's checkpoint (the latest, or a step) onto
one device or onto a mesh, with the model rebuilt from that checkpoint's config record;
:func:`open_checkpoint` opens one for reading any part of it; :func:`run_tokenizer` is
the run's tokenizer. A missing run, checkpoint or step is a ``UsageError``.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

import models
from train.cli import UsageError
from train.run import config as config_lib
from train.run import preflight
from train.store import checkpoint as ckpt_lib
from train.store import hf as hf_io
from train.store import rundir


class Restored(NamedTuple):
  cfg: models.GPTConfig
  graphdef: Any
  # pure dict; on one device blocks in layer order [L, ...] (groups with moe_every), the
  # unstacked module's own layout; on a mesh laid out as models.init(cfg, par)'s
  params: Any
  step: int


def checkpoint_path(run_dir: str) -> str:
  """The run's checkpoint directory: its config's ``--ckpt-dir``, else RUN_DIR/checkpoints."""
  saved = config_lib.saved_config(run_dir)
  return config_lib.Config(**{**saved, "run_dir": run_dir}).ckpt_path


@contextlib.contextmanager
def open_checkpoint(run_dir: str, step: int | None = None, picks_step: str | None = "--step"
                    ) -> Iterator[tuple[ocp.CheckpointManager, int, models.GPTConfig]]:
  """``(manager, step, cfg)`` of checkpoint ``step`` (the latest when None) of ``run_dir``,
  closed on exit. The manager reads the state through the PyTree handler, which restores
  any part of it (``partial_restore``): the parameters without the optimizer state the
  trainer saved beside them, or one leaf at a time (``train.export``).
  ``train.store.checkpoint.Checkpoints`` restores whole states only."""
  rundir.check_run(run_dir)
  where = checkpoint_path(run_dir)
  if not os.path.isdir(where):
    raise UsageError(f"{where} does not exist: the run has no checkpoints yet; train it"
                     " (python -m train.gpt --run-dir RUN_DIR) first")
  # "meta" is registered so that Orbax does not warn about an item it cannot read.
  ckpt_lib.quiet_orbax_logs()
  manager = ocp.CheckpointManager(
      where, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                     "config": ocp.JsonCheckpointHandler()})
  try:
    steps = manager.all_steps()
    if not steps:
      raise UsageError(f"{where} holds no complete checkpoint; train the run (or let its"
                       " first --save-every step finish) first")
    if step is None:
      step = max(steps)
    elif step not in steps and picks_step == preflight.RESUMED_START:
      raise UsageError(f"{where} has no checkpoint of step {step}, which --resume reads (its run started from"
                       f" it); put it back, or start a new run (another --run-dir, without --resume) from step"
                       f" {max(steps)}, the latest, which --init-from takes")
    elif step not in steps:
      raise UsageError(f"--step {step}: {where} has checkpoints at steps"
                       f" {', '.join(map(str, sorted(steps)))}; pass one of them")
    with preflight.reading(picks_step, where, step):
      record = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
      # XLA's attention runs on any device; the run may have trained with cuDNN's on a GPU.
      # A delayed FP8 run's histories are training state: its model computes with current scaling.
      cfg = models.GPTConfig(**{**record["model"], "attention": "xla"})
      cfg = models.fp8.for_inference(cfg)
    yield manager, step, cfg
  finally:
    manager.close()


def restore(run_dir: str, step: int | None = None, par: models.Parallelism | None = None,
            picks_step: str | None = "--step") -> Restored:
  """The GPT of checkpoint ``step`` (the latest when None) of ``run_dir``: on one device,
  or, given ``par``, sharded on its mesh like ``models.init(cfg, par)`` (call it under
  ``jax.set_mesh(par.mesh)``; each process reads only its devices' slices). ``picks_step``:
  the command's flag that picks a step, named if the checkpoint is damaged or missing (None: none
  does; ``preflight.RESUMED_START``: a resumed train.grpo run's start, which none changes)."""
  with open_checkpoint(run_dir, step, picks_step) as (manager, step, cfg):
    with preflight.reading(picks_step, checkpoint_path(run_dir), step):
      shapes = manager.item_metadata(step)["state"]["params"]
    if par is None:
      graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))))
      target = shapes
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    else:
      try:
        graphdef, like = models.abstract(cfg, par)
      except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None
      target = ckpt_lib.saved_structs(shapes, like)
      restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                                                 dtype=s.dtype), target)
    with preflight.reading(picks_step, checkpoint_path(run_dir), step):
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item={"params": target}, restore_args={"params": restore_args}, partial_restore=True)))["state"]
  if par is None:
    return Restored(cfg, graphdef, jax.device_put(state["params"]), step)
  return Restored(cfg, graphdef, ckpt_lib.from_saved(state["params"], like, par.pp, par.virtual_stages), step)


def tokenizer_dir(run_dir: str) -> str | None:
  """Where the run's tokenizer files are (its RUN_DIR/tokenizer copy, else its --init-from
  hf:DIR); None: bytes."""
  return hf_io.tokenizer_dir(run_dir, config_lib.saved_config(run_dir).get("init_from"))


def run_tokenizer(run_dir: str):
  """The run's tokenizer (:func:`tokenizer_dir`'s), else bytes."""
  return hf_io.load_tokenizer(tokenizer_dir(run_dir))


def check_sampling(temperature: float, top_k: int | None, top_p: float, greedy: bool = True) -> None:
  """Raises UsageError for sampling flags ``models.generate.Sampling`` cannot take; a
  ``--temperature`` of 0 (greedy) only where ``greedy`` is allowed."""
  lowest = 0 if greedy else math.nextafter(0, 1)
  if not (math.isfinite(temperature) and temperature >= lowest):
    raise UsageError(f"--temperature must be a finite number {'>= 0 (0 is greedy)' if greedy else '> 0 (it samples)'},"
                     f" got {temperature}")
  if not 0 < top_p <= 1:
    raise UsageError(f"--top-p must be in (0, 1] (1 keeps every token), got {top_p}")
  if top_k is not None and top_k < 1:
    raise UsageError(f"--top-k must be positive, got {top_k}")
