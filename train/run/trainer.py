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
from models import context
from train.cli import UsageError
from train.run import optim, preflight, spikes
from train.run import step as step_lib
from train.run.config import Config
from train.store import checkpoint as ckpt_lib


def batch_split(cfg: Config, mesh: jax.sharding.Mesh) -> int:
  """Micro-batches per step, after checking that the batch splits over the mesh."""
  sizes = dict(mesh.shape)
  dp = sizes["rp"] * sizes["fs"] * sizes["ep"]
  if cfg.global_batch_size % dp:
    raise UsageError(f"--global-batch-size {cfg.global_batch_size} does not split over the {dp}"
                     f" data-parallel ranks (rp x fs x ep = {sizes['rp']} x {sizes['fs']} x"
                     f" {sizes['ep']}); choose a multiple of {dp}")
  per_rank = cfg.global_batch_size // dp
  # A pipeline needs micro-batches in multiples of pp: by default exactly pp of them.
  micro = cfg.micro_batch_size or max(per_rank // sizes["pp"], 1)
  if per_rank % micro:
    raise UsageError(f"--micro-batch-size {micro} does not divide the {per_rank} sequences per"
                     f" data-parallel rank (--global-batch-size {cfg.global_batch_size} over"
                     f" {dp} ranks); choose a divisor of {per_rank}")
  return per_rank // micro


def parallelism(cfg: Config, mesh: jax.sharding.Mesh, accum: int) -> models.Parallelism:
  """The model's parallelism: with pp > 1 the ``accum`` micro-batches flow through the pipeline."""
  pp = dict(mesh.shape)["pp"]
  return models.Parallelism(mesh, sequence_parallel=cfg.sequence_parallel, microbatches=accum if pp > 1 else 1,
                            virtual_stages=cfg.virtual_stages)


def compute_settings(cfg: Config) -> dict:
  """The model's compute dtype, attention and remat of the flags (``--dtype`` default:
  bfloat16 on GPU, float32 on CPU)."""
  dtype = cfg.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  fused = jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16")
  if cfg.attention == "cudnn" and not fused:
    raise UsageError(f"--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 or float16"
                     f" (here: {jax.default_backend()}, {dtype}); use --attention xla")
  attention = ("cudnn" if fused else "xla") if cfg.attention == "auto" else cfg.attention
  return {"dtype": dtype, "attention": attention, "remat": cfg.remat}


def check_model(cfg: Config, model_cfg: models.GPTConfig, mesh: jax.sharding.Mesh) -> None:
  """The model fits the flags and the mesh: QK-clip's needs, the sequence over cp, the experts over ep."""
  if cfg.qk_clip_threshold is not None:
    try:
      models.qk_clip.check(model_cfg, cfg.qk_clip_threshold)
    except ValueError as e:
      raise UsageError(f"--qk-clip-threshold: {e}") from None
  try:
    context.check_seq_len(model_cfg.seq_len, dict(mesh.shape)["cp"])
  except ValueError as e:
    raise UsageError(f"--seq-len / --mesh: {e}") from None
  preflight.check_experts(model_cfg, mesh)


def make_trainer(cfg: Config, model_cfg: models.GPTConfig, graphdef: Any, params: Any, par: models.Parallelism,
                 accum: int, objective: Callable | None = None, temperature: float = 1.0
                 ) -> tuple[step_lib.TrainState, Callable]:
  """The optimizer's initial state and the jitted step (``train/run/step.py``) of ``cfg``'s
  optimizer, schedule, clipping, float16 loss scaling, QK-clip and spike skipping, over ``accum``
  micro-batches; with ``objective`` (at ``temperature``) a per-token objective in place of
  the cross-entropy (``models.loss``'s). Call under ``jax.set_mesh(par.mesh)``."""
  tx = optim.optimizer(cfg, params, par.mesh, models.param_specs(params))
  scaling = step_lib.Scaling(cfg.loss_scale_window, cfg.min_loss_scale) if model_cfg.dtype == "float16" else None
  state = step_lib.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), fresh_loss_scale(cfg, model_cfg),
                              spikes.empty())
  qk_clip = None if cfg.qk_clip_threshold is None else (cfg.qk_clip_threshold, model_cfg)
  train_step = step_lib.make_train_step(graphdef, par, tx, optim.schedule(cfg),
                                        optim.per_replica_mask(cfg, params, par.mesh), 1 if par.pp > 1 else accum,
                                        cfg.clip_grad, scaling, qk_clip, cfg.skip_spikes, objective, temperature,
                                        cfg.grad_norm)
  return state, train_step


def fresh_loss_scale(cfg: Config, model_cfg: models.GPTConfig) -> step_lib.LossScale:
  """float16's initial loss scale (``--initial-loss-scale``); 1 for other dtypes."""
  return step_lib.initial_loss_scale(cfg.initial_loss_scale if model_cfg.dtype == "float16" else 1.0)


def resume_state(checkpoints: ckpt_lib.Checkpoints, step: int, state: step_lib.TrainState, cfg: Config,
                 model_cfg: models.GPTConfig, par: models.Parallelism
                 ) -> tuple[step_lib.TrainState, dict | None, dict | None]:
  """``(state, meta, record)`` of checkpoint ``step`` laid out like ``state`` on ``par``'s
  mesh, after checking it holds this model and optimizer; ``state`` and None, None at step 0."""
  if not step:
    return state, None, None
  with preflight.reading("--resume --step", checkpoints.directory, step):
    meta, saved = checkpoints.read_json(step)
    preflight.check_same_model(saved, model_cfg, cfg, checkpoints.directory)
    with jax.set_mesh(par.mesh):
      restored = checkpoints.restore_state(step, state, par.pp, par.virtual_stages)
  if saved["model"]["dtype"] != model_cfg.dtype:  # a scale belongs to the dtype it was found for
    restored = restored._replace(loss_scale=state.loss_scale)
  return restored, meta, saved
