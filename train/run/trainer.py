"""What a run trains, from its :class:`~train.run.config.Config`: the model's compute
settings and checks, its parallelism, the optimizer and its jitted step
(``train/run/step.py``), and a state resumed from a checkpoint. Shared by ``python -m
train.gpt`` (``train/run/setup.py``) and ``python -m train.grpo``, which passes GRPO's
per-token objective to :func:`make_trainer`. Each check raises ``UsageError`` with one line.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import models
from train.cli import UsageError
from train.run import optim, preflight, spikes
from train.run import step as step_lib
from train.run.config import Config
from train.store import checkpoint as ckpt_lib


def parallelism(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[models.Parallelism, int]:
  """The model's parallelism and the micro-batches per step, after checking that the batch
  splits over the mesh; with pp > 1 the micro-batches flow through the pipeline."""
  sizes = dict(mesh.shape)
  dp = sizes["rp"] * sizes["fs"] * sizes["ep"]
  if cfg.global_batch_size % dp:
    raise UsageError(f"--global-batch-size {cfg.global_batch_size} does not split over the {dp}"
                     f" data-parallel ranks (rp x fs x ep = {sizes['rp']} x {sizes['fs']} x"
                     f" {sizes['ep']}); choose a multiple of {dp}")
  per_rank, pp = cfg.global_batch_size // dp, sizes["pp"]
  # A pipeline needs micro-batches in multiples of pp: by default exactly pp of them.
  if per_rank % pp:
    raise UsageError(f"--mesh pp={pp} needs micro-batches in multiples of {pp}, and each data-parallel rank's"
                     f" {per_rank} sequences (--global-batch-size {cfg.global_batch_size} over {dp} ranks) do not"
                     f" split so; choose a --global-batch-size that is a multiple of {dp * pp}")
  micro = cfg.micro_batch_size or max(per_rank // pp, 1)
  if per_rank % micro:
    raise UsageError(f"--micro-batch-size {micro} does not divide the {per_rank} sequences per"
                     f" data-parallel rank (--global-batch-size {cfg.global_batch_size} over"
                     f" {dp} ranks); choose a divisor of {per_rank}")
  accum = per_rank // micro
  if pp > 1 and accum % pp:
    raise UsageError(f"--micro-batch-size {micro} makes {accum} micro-batches of the {per_rank} sequences per"
                     f" data-parallel rank, and the pipeline (--mesh pp={pp}) needs a multiple of {pp};"
                     f" choose a --micro-batch-size that divides {per_rank // pp}")
  par = models.Parallelism(mesh, sequence_parallel=cfg.sequence_parallel,
                           microbatches=accum if sizes["pp"] > 1 else 1, virtual_stages=cfg.virtual_stages)
  return par, accum


def make_trainer(cfg: Config, model_cfg: models.GPTConfig, graphdef: Any, params: Any, par: models.Parallelism,
                 accum: int, objective: Callable | None = None, temperature: float = 1.0
                 ) -> tuple[step_lib.TrainState, Callable]:
  """The optimizer's initial state and the jitted step (``train/run/step.py``) of ``cfg``'s
  optimizer, schedule, clipping, float16 loss scaling, QK-clip and spike skipping, over ``accum``
  micro-batches; with ``objective`` (at ``temperature``) a per-token objective in place of
  the cross-entropy (``models.loss``'s); with ``--offload-optimizer`` the optimizer state in
  pinned host memory; with ``--fp8 delayed`` the state's ``fp8`` holds empty amax histories
  (``models/fp8.py``) and ``params`` none (any in ``params`` are dropped). Call under
  ``jax.set_mesh(par.mesh)``."""
  params, fp8 = models.fp8.split_state(params)
  if model_cfg.fp8 == "delayed":
    fp8 = fresh_histories(model_cfg, par)
  tx = optim.optimizer(cfg, params, par.mesh, models.param_specs(params))
  scaling = step_lib.Scaling(cfg.loss_scale_window, cfg.min_loss_scale) if model_cfg.dtype == "float16" else None
  # float16's initial loss scale (--initial-loss-scale); 1 for other dtypes.
  loss_scale = step_lib.initial_loss_scale(cfg.initial_loss_scale if model_cfg.dtype == "float16" else 1.0)
  opt_state = tx.init(params)
  if cfg.offload_optimizer:
    opt_state = step_lib.on_host(opt_state)
  state = step_lib.TrainState(params, opt_state, jnp.zeros((), jnp.int32), loss_scale, spikes.empty(), fp8)
  qk_clip = None if cfg.qk_clip_threshold is None else (cfg.qk_clip_threshold, model_cfg)
  train_step = step_lib.make_train_step(graphdef, par, tx, optim.schedule(cfg),
                                        optim.per_replica_mask(cfg, params, par.mesh), 1 if par.pp > 1 else accum,
                                        cfg.clip_grad, scaling, qk_clip, cfg.skip_spikes, objective, temperature,
                                        cfg.grad_norm, cfg.grad_norm_sketch_size, cfg.offload_optimizer)
  return state, train_step


def fresh_histories(model_cfg: models.GPTConfig, par: models.Parallelism) -> Any:
  """``--fp8 delayed``'s empty amax histories on ``par``'s mesh (zeros: the first step scales
  by each tensor's own amax)."""
  shapes = models.fp8.split_state(models.abstract(model_cfg, par)[1])[1]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), shapes)


def checkpoint_record(checkpoints: ckpt_lib.Checkpoints, step: int, cfg: Config, model_cfg: models.GPTConfig
                      ) -> tuple[dict, dict]:
  """``(meta, record)`` of checkpoint ``step`` (its JSON), after checking that it holds this
  model and optimizer: a ``UsageError`` otherwise, read before any array is."""
  with preflight.reading("--resume --step", checkpoints.directory, step):
    meta, saved = checkpoints.read_json(step)
    preflight.check_same_model(saved, model_cfg, cfg, checkpoints.directory)
    if saved["model"].get("fp8") == "delayed" and model_cfg.fp8 != "delayed":
      raise UsageError(f"the checkpoint in {checkpoints.directory} holds --fp8 delayed's amax histories;"
                       " resume with --fp8 delayed (the recipe it trained with) or start a new --run-dir")
  return meta, saved


def resume_state(checkpoints: ckpt_lib.Checkpoints, step: int, state: step_lib.TrainState, cfg: Config,
                 model_cfg: models.GPTConfig, par: models.Parallelism
                 ) -> tuple[step_lib.TrainState, dict | None, dict | None]:
  """``(state, meta, record)`` of checkpoint ``step`` laid out like ``state`` on ``par``'s
  mesh, after checking it holds this model and optimizer; ``state`` and None, None at step 0."""
  if not step:
    return state, None, None
  meta, saved = checkpoint_record(checkpoints, step, cfg, model_cfg)
  if jax.process_index() == 0:
    print(f"restoring the checkpoint of step {step} from {checkpoints.directory}", flush=True)
  with preflight.reading("--resume --step", checkpoints.directory, step), jax.set_mesh(par.mesh):
    restored = checkpoints.restore_state(step, state, par.pp, par.virtual_stages)
  if saved["model"]["dtype"] != model_cfg.dtype:  # a scale belongs to the dtype it was found for
    restored = restored._replace(loss_scale=state.loss_scale)
  return restored, meta, saved
