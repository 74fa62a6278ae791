"""The training run: setup (mesh, data, model, optimizer, checkpoint) and the loop.

:func:`setup` checks everything a run needs before it writes anything, raising
``UsageError`` / ``ValueError`` with one line that names the problem and the fix;
:func:`train` then runs the steps, logs, evaluates and saves.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import data
import dion_jax
import models
from dion_jax.parallel import format_mesh_spec
from models import context
from train import checkpoint as ckpt_lib
from train import comm
from train import evaluation
from train import hf as hf_io
from train import optim
from train import preflight
from train import rundir
from train import step as step_lib
from train.cli import UsageError
from train.config import Config
from train.interrupt import Agreement, Interrupt
from train.log import Logger

EXIT_FAILED = 1
EXIT_DIVERGED = 3

@dataclasses.dataclass
class Run:
  cfg: Config
  model_cfg: models.GPTConfig
  mesh: jax.sharding.Mesh
  par: models.Parallelism
  state: step_lib.TrainState
  start_step: int
  train_step: Any
  eval_step: Any
  train_batches: Any  # grain iterator of this process's rows
  valid_rows: dict | None  # the validation set, int32 [R, seq_len] each (``train/evaluation.py``)
  batch_sharding: NamedSharding
  checkpoints: ckpt_lib.Checkpoints
  saved_config: dict
  eod: int | None  # the end-of-document token when windows carry document masks
  lock: rundir.Lock
  steps_per_epoch: int | None  # sft: data: steps of one pass over its rows (None for token data)
  examples: int | None  # sft: data: examples consumed before start_step (None: not recorded)


def make_mesh(spec: str) -> jax.sharding.Mesh:
  """The mesh of a ``--mesh`` spec over the first devices (all of them with several
  processes); a spec the devices cannot hold is a UsageError."""
  devices = jax.devices()
  try:
    sizes = dion_jax.parse_mesh_spec(spec)
  except ValueError as e:
    raise UsageError(f"--mesh: {e}") from None
  needed = math.prod(sizes.values())
  spec = format_mesh_spec(sizes)
  if needed > len(devices) or (jax.process_count() > 1 and needed != len(devices)):
    raise UsageError(f"--mesh {spec} needs {needed} devices but {len(devices)}"
                     f" {devices[0].platform} devices exist; choose axis sizes whose product is"
                     f" at most {len(devices)}")
  return dion_jax.make_mesh(sizes, devices[:needed])


def _attention(cfg: Config, dtype: str) -> str:
  fused = jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16")
  if cfg.attention == "auto":
    return "cudnn" if fused else "xla"
  if cfg.attention == "cudnn" and not fused:
    raise UsageError(f"--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 or float16"
                     f" (here: {jax.default_backend()}, {dtype}); use --attention xla")
  return cfg.attention


# MoE flags that change the training, not the weights: they apply to imported models too.
_ROUTING_FLAGS = ("moe_capacity_factor", "moe_aux_loss_coeff", "moe_z_loss_coeff")


def _model_config(cfg: Config, vocab_size: int | None) -> models.GPTConfig:
  dtype = cfg.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  if cfg.hf_dir is not None:
    hf_config = hf_io.read_config(cfg.hf_dir)
    longest = hf_config.get("max_position_embeddings")
    if cfg.seq_len and longest and cfg.seq_len > longest:
      raise UsageError(f"--seq-len {cfg.seq_len} exceeds the {longest} positions {cfg.hf_dir} was"
                       f" trained for (max_position_embeddings); choose at most {longest}")
    seq_len = cfg.seq_len or min(longest or 1024, 1024)
    routing = {name: getattr(cfg, name) for name in _ROUTING_FLAGS if getattr(cfg, name) is not None}
    return hf_io.model_config(cfg.hf_dir, seq_len=seq_len, dtype=dtype, remat=cfg.remat,
                              attention=_attention(cfg, dtype), **routing)
  overrides = {"vocab_size": vocab_size, "remat": cfg.remat, "dtype": dtype,
               "attention": _attention(cfg, dtype)}
  for flag, field in (("num_layers", "num_layers"), ("hidden_size", "d_model"),
                      ("num_attention_heads", "num_heads"), ("seq_len", "seq_len"), ("qk_norm", "qk_norm"),
                      ("num_experts", "num_experts"), ("moe_top_k", "moe_top_k"), ("moe_every", "moe_every"),
                      ("moe_ffn_hidden_size", "moe_mlp_dim"),
                      *((name, name) for name in _ROUTING_FLAGS)):
    if getattr(cfg, flag) is not None:
      overrides[field] = getattr(cfg, flag)
  if cfg.moe_shared_expert:
    overrides["moe_shared_expert"] = True
  try:
    return models.preset(cfg.preset, **overrides)
  except ValueError as e:
    raise UsageError(str(e)) from None


def _tokenizer(cfg: Config):
  """The tokenizer of sft: data: the run's copy of --init-from's (``train/hf.py``), else
  --init-from's tokenizer.json when it has one, else bytes."""
  return hf_io.load_tokenizer(hf_io.tokenizer_dir(cfg.run_path, cfg.init_from))


def _batch_split(cfg: Config, mesh: jax.sharding.Mesh) -> int:
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


def _loss_scaling(cfg: Config, model_cfg: models.GPTConfig) -> tuple[step_lib.Scaling | None, float]:
  """float16's dynamic loss scaling and its initial scale; none (scale 1) for other dtypes."""
  if model_cfg.dtype != "float16":
    return None, 1.0
  return step_lib.Scaling(cfg.loss_scale_window, cfg.min_loss_scale), cfg.initial_loss_scale


def config_record(cfg: Config, model_cfg: models.GPTConfig) -> dict:
  train = dataclasses.replace(cfg, run_dir=cfg.run_path,
                              ckpt_dir=cfg.ckpt_path if cfg.ckpt_dir else None).to_json()
  record = {"train": train, "model": dataclasses.asdict(model_cfg)}
  if cfg.hf_dir is not None:  # what train.export writes back, even if the directory goes
    record["hf_config"] = hf_io.read_config(cfg.hf_dir)
  return record


def setup(cfg: Config) -> Run:
  lock = rundir.Lock(cfg.run_path)
  primary = jax.process_index() == 0
  if primary:
    preflight.check_run_dir(cfg, lock)
  mesh = make_mesh(cfg.mesh or f"fs={len(jax.devices())}")
  accum = _batch_split(cfg, mesh)
  pp = dict(mesh.shape)["pp"]
  tokenizer = _tokenizer(cfg)
  eod = tokenizer.eod if cfg.document_mask else None
  source = data.load_source(cfg.data_spec, progress=jax.process_index() == 0, tokenizer=tokenizer,
                            packed=cfg.pack)
  valid_source = (data.load_source(cfg.valid_spec, progress=False, tokenizer=tokenizer, packed=cfg.pack)
                  if cfg.valid_spec else None)
  vocab = cfg.vocab_size or source.vocab_size
  if vocab is None and cfg.hf_dir is None:
    raise UsageError(f"--data {' '.join(cfg.data)} does not record its vocabulary size; pass"
                     " --vocab-size (e.g. 50257 for GPT-2 tokens)")
  model_cfg = _model_config(cfg, vocab)
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
  preflight.check_data(cfg, model_cfg, source, valid_source, eod)
  valid_rows = None
  if valid_source is not None and cfg.eval_tokens > 0:
    # Fine-tuning data is evaluated whole, as train.eval evaluates it; token data up to --eval-tokens.
    limit = None if isinstance(valid_source, data.SFTSource) else max(1, cfg.eval_tokens // model_cfg.seq_len)
    valid_rows = data.ordered_rows(valid_source, seq_len=model_cfg.seq_len, limit=limit, eod=eod)
  steps_per_epoch = None
  if isinstance(source, data.SFTSource):
    steps_per_epoch = len(data.make_dataset(source, seq_len=model_cfg.seq_len,
                                            global_batch_size=cfg.global_batch_size, num_epochs=1))
  existing = ckpt_lib.existing_steps(cfg.ckpt_path)
  preflight.check_resumable(cfg, existing)
  par = models.Parallelism(mesh, sequence_parallel=cfg.sequence_parallel,
                           microbatches=accum if pp > 1 else 1, virtual_stages=cfg.virtual_stages)

  batch_sharding = NamedSharding(mesh, P(models.BATCH_AXES))
  shard = data.process_batch_shard(batch_sharding, (cfg.global_batch_size, model_cfg.seq_len))
  train_batches = data.make_loader(source, seq_len=model_cfg.seq_len,
                                   global_batch_size=cfg.global_batch_size, seed=cfg.seed,
                                   shard_index=shard[0], shard_count=shard[1], eod=eod)
  with jax.set_mesh(mesh):
    if cfg.hf_dir is not None and not cfg.resume:
      graphdef, params = hf_io.load(cfg.hf_dir, model_cfg, par)
    else:
      graphdef, params = models.init(model_cfg, par, cfg.seed)
    tx = optim.optimizer(cfg, params, mesh, models.param_specs(params))
    scaling, initial_scale = _loss_scaling(cfg, model_cfg)
    fresh_scale = step_lib.initial_loss_scale(initial_scale)
    state = step_lib.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), fresh_scale)
    train_step = step_lib.make_train_step(graphdef, par, tx, optim.schedule(cfg),
                                          optim.per_replica_mask(cfg, params, mesh),
                                          1 if pp > 1 else accum, cfg.clip_grad, scaling,
                                          None if cfg.qk_clip_threshold is None else
                                          (cfg.qk_clip_threshold, model_cfg), cfg.grad_norm)
    eval_step = step_lib.make_eval_step(graphdef, par, 1 if pp > 1 else accum)

  checkpoints = ckpt_lib.Checkpoints(cfg.ckpt_path, cfg.keep, create=False)  # made below, once checked
  start_step, record, examples = 0, config_record(cfg, model_cfg), 0
  if cfg.resume:
    start_step = preflight.resume_step(cfg, existing)
    with preflight.reading("--resume --step", cfg.ckpt_path, start_step):
      meta, saved = checkpoints.read_json(start_step)
      preflight.check_same_model(saved, model_cfg, cfg, cfg.ckpt_path)
      with jax.set_mesh(mesh):
        state = checkpoints.restore_state(start_step, state, pp, cfg.virtual_stages)
      train_batches.set_state(meta["data"])
      examples = meta.get("examples")  # None: saved before examples were counted
    if saved["model"]["dtype"] != model_cfg.dtype:  # a scale belongs to the dtype it was found for
      state = state._replace(loss_scale=fresh_scale)
    if start_step >= cfg.steps:
      raise UsageError(f"--resume: the checkpoint is at step {start_step}, which already reaches"
                       f" --steps {cfg.steps}; pass a larger --steps to train further")
  # Compiled now (the first step reuses it) to refuse a step the devices cannot hold before
  # anything is written; the first batch is read and put back.
  position = train_batches.get_state()
  first = _global_batch(batch_sharding, (cfg.global_batch_size, model_cfg.seq_len), next(train_batches))
  train_batches.set_state(position)
  if primary:
    print("compiling the training step", flush=True)
  t0 = time.perf_counter()
  compiled = compile_within_memory(train_step, state, first, mesh, model_cfg)
  record["communication"] = comm.describe(compiled, mesh, cfg, params, models.param_specs(params))
  if primary:
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s", flush=True)
    print("\n".join(comm.lines(record["communication"], mesh)), flush=True)
    lock.acquire()
    os.makedirs(cfg.ckpt_path, exist_ok=True)
    if cfg.hf_dir is not None and os.path.isdir(cfg.hf_dir):
      hf_io.copy_tokenizer(cfg.hf_dir, cfg.run_path)
    if preflight.drop_newer(cfg, start_step, existing):
      checkpoints.manager.reload()
    if cfg.resume:
      preflight.schedule_warning(cfg, saved["train"])
    with open(os.path.join(cfg.run_path, "config.json"), "w") as f:
      json.dump(record, f, indent=2)
  return Run(cfg, model_cfg, mesh, par, state, start_step, train_step, eval_step, train_batches,
             valid_rows, batch_sharding, checkpoints, record, eod, lock, steps_per_epoch, examples)


def compile_within_memory(train_step, state: Any, batch: dict, mesh: jax.sharding.Mesh,
                          model_cfg: models.GPTConfig) -> jax.stages.Compiled:
  """Compiles the step for ``state`` and ``batch`` (later calls reuse the executable) and
  refuses one whose memory the devices cannot hold (``preflight.check_memory``)."""
  with jax.set_mesh(mesh):
    compiled = train_step.lower(state, batch).compile()
  preflight.check_memory(compiled.memory_analysis(), mesh, model_cfg)
  return compiled


def global_batch(run: Run, local: dict) -> dict:
  """This process's rows of a batch (the loader's output) as one global array per key."""
  return _global_batch(run.batch_sharding, (run.cfg.global_batch_size, run.model_cfg.seq_len), local)


def _global_batch(sharding: NamedSharding, shape: tuple[int, int], local: dict) -> dict:
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), shape) for k, v in local.items()}


def evaluate(run: Run, state: step_lib.TrainState) -> tuple[float, int]:
  """The validation loss (``train/evaluation.py``: the mean over every counted target of
  the validation rows, each row once) and the targets it counted."""
  with jax.set_mesh(run.mesh):
    return evaluation.mean_loss(run.eval_step, state.params, run.valid_rows, run.cfg.global_batch_size,
                                run.batch_sharding)


# Examples in a global batch of packed rows: each row's last segment id is its count.
count_examples = jax.jit(lambda segment_ids_BxT: jnp.sum(jnp.max(segment_ids_BxT, axis=1)))


def save(run: Run, step: int, state: step_lib.TrainState, examples: int) -> None:
  with jax.set_mesh(run.mesh):
    tree = ckpt_lib.to_saved(state, dict(run.mesh.shape)["pp"], run.cfg.virtual_stages)
  meta = {"step": step, "data": run.train_batches.get_state(), "examples": examples}
  run.checkpoints.save(step, tree, meta, run.saved_config)


def train(run: Run) -> int:
  """Runs the steps; holds the run directory's lock until it returns. Exit codes: 0 done,
  1 a checkpoint failed to save, 3 diverged, 130 / 143 stopped by SIGINT / SIGTERM
  (``train/interrupt.py``)."""
  def on_second():
    rundir.remove_partial_saves(run.cfg.ckpt_path)
    run.lock.release()

  try:
    with Interrupt(on_second) as interrupt:
      return _train(run, interrupt)
  finally:
    rundir.remove_partial_saves(run.cfg.ckpt_path)
    run.lock.release()


def _train(run: Run, interrupt: Interrupt) -> int:
  cfg = run.cfg
  tokens_per_step = cfg.global_batch_size * run.model_cfg.seq_len
  logger = Logger(cfg.run_path, cfg.steps, tokens_per_step, run.model_cfg.flops_per_token(),
                  run.mesh.size, jax.devices()[0].device_kind, jax.process_index() == 0,
                  run.steps_per_epoch, run.examples)
  mesh_desc = format_mesh_spec(dict(run.mesh.shape))
  logger.message(f"training {cfg.init_from or cfg.preset} ({run.model_cfg.num_params() / 1e6:.2f}M parameters,"
                 f" {run.model_cfg.dtype}) with {cfg.optimizer} on mesh {mesh_desc}"
                 f" ({jax.process_count()} process(es)), steps {run.start_step + 1}..{cfg.steps},"
                 f" run directory {cfg.run_path}")
  if cfg.ignored_flags():
    logger.message(f"warning: --optimizer {cfg.optimizer} does not read {', '.join(cfg.ignored_flags())};"
                   " they are recorded in config.json but change nothing")
  state, consecutive = run.state, 0
  pending = None  # the previous step's metrics, read while the next step runs
  scaled = run.model_cfg.dtype == "float16"

  def account(step: int, metrics: step_lib.StepMetrics, examples: jax.Array | None) -> None:
    nonlocal consecutive
    m = jax.device_get(metrics)
    logger.step(float(m.loss - m.router_loss), float(m.grad_norm), float(m.learning_rate), bool(m.skipped),
                float(m.loss_scale) if scaled else None,
                None if cfg.qk_clip_threshold is None else (float(m.max_logit), int(m.clipped_heads)),
                (float(m.router_loss), float(m.expert_load), float(m.dropped)) if run.model_cfg.num_experts else None,
                None if examples is None else int(examples))
    consecutive = consecutive + 1 if m.skipped else 0
    if step % cfg.log_interval == 0 or step == cfg.steps:
      logger.flush(step)

  start = time.perf_counter()
  step = run.start_step
  agreement = Agreement(run.mesh)
  try:
    for step in range(run.start_step + 1, cfg.steps + 1):
      with jax.set_mesh(run.mesh):
        batch = global_batch(run, next(run.train_batches))
        state, metrics = run.train_step(state, batch)
        examples = count_examples(batch["segment_ids"]) if run.steps_per_epoch else None
      run.checkpoints.check_for_errors()
      stop = agreement(interrupt.signum or 0)  # a signal to any process stops all after this step
      if pending is not None:
        account(*pending)
      pending = (step, metrics, examples)
      if consecutive >= cfg.max_skipped:
        break
      is_last = step == cfg.steps
      evaluating = run.valid_rows is not None and (
          is_last or (cfg.eval_every and step % cfg.eval_every == 0))
      saving = is_last or stop or (cfg.save_every and step % cfg.save_every == 0)
      if evaluating or saving:
        account(*pending)
        pending = None
        if consecutive >= cfg.max_skipped:
          break
      if evaluating:
        t0 = time.perf_counter()
        loss, targets = evaluate(run, state)
        logger.validation(step, loss, targets, time.perf_counter() - t0)
      if saving:
        save(run, step, state, logger.examples)
        logger.message(f"saving the checkpoint of step {step} to {cfg.ckpt_path} (in the background)")
      if stop:
        break
    if pending is not None:
      account(*pending)
    run.checkpoints.close()
  except ckpt_lib.SaveError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_FAILED
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    kept = run.checkpoints.saving or run.start_step
    kept = f"the checkpoint of step {kept} is in {cfg.ckpt_path}" if kept else "no checkpoint was written"
    print(f"error: out of device memory at step {step} ({str(e).splitlines()[0][:160]}); {kept}; lower"
          " --micro-batch-size or --seq-len, add --remat, or shard over more devices (--mesh)",
          file=sys.stderr)
    return EXIT_FAILED
  finally:
    logger.close()
  last_saved = run.checkpoints.saving or run.start_step
  signum = agreement.latest()
  if signum:
    where = "" if interrupt.signum == signum else " sent to another process"
    print(f"error: stopped by {signal.Signals(signum).name}{where} after step {step}; the checkpoint of"
          f" step {last_saved} is saved in {cfg.ckpt_path}; continue with --resume", file=sys.stderr)
    return 128 + signum
  if consecutive >= cfg.max_skipped:
    kept = (f"the last good checkpoint is step {last_saved} in {cfg.ckpt_path}" if last_saved
            else "no checkpoint was written")
    print(f"error: stopped after {consecutive} consecutive iterations with a non-finite loss,"
          f" gradient or update (--max-skipped {cfg.max_skipped}); {kept}; lower --lr, raise"
          " --lr-warmup-steps or check the data", file=sys.stderr)
    return EXIT_DIVERGED
  if not jax.jit(step_lib.all_finite)(state.params, state.opt_state):
    # The step's guard keeps a finite state finite, so this one started non-finite.
    origin = (f"as in the checkpoint of step {run.start_step} in {cfg.ckpt_path} it resumed from"
              if run.start_step else "from the initialization")
    print(f"error: the parameters or optimizer state are not finite at the end of the run,"
          f" {origin}, and every step on them is skipped; resume from an earlier checkpoint or"
          " start a new --run-dir", file=sys.stderr)
    return EXIT_DIVERGED
  logger.message(f"done: {cfg.steps - run.start_step} steps in {time.perf_counter() - start:.1f} s")
  return 0
