"""A training run, set up and stepped: ``python -m train.gpt``'s, and the parts
``python -m train.grpo`` shares with it.

:func:`setup` reads as its steps: check the run directory, make the mesh, load the data,
make the model, make the trainer (optimizer and jitted step, ``train/run/trainer.py``), resume
its state, compile the step within the devices' memory, then take the directory.
Each check raises ``UsageError`` / ``ValueError`` with one line that names the problem and
the fix, before anything is written. :func:`train` runs the steps in :func:`run_loop`,
which holds the directory and turns the loop's end into an exit code, as it does for
GRPO's loop.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import data
import dion_jax
import models
from dion_jax.parallel import format_mesh_spec
from train.cli import UsageError
from train.run import comm, evaluation, peers, preflight, trainer
from train.run import step as step_lib
from train.run.config import Config
from train.run.interrupt import Agreement, Interrupt
from train.store import checkpoint as ckpt_lib
from train.store import hf as hf_io
from train.store import profiling, rundir, tracking
from train.store.log import Logger

EXIT_FAILED = 1
EXIT_DIVERGED = 3


class Batches(NamedTuple):
  """train.gpt's data: the loader of this process's rows and what evaluates and counts them."""
  loader: Any  # grain iterator of this process's rows, its position checkpointed
  sharding: NamedSharding  # a global batch's, over the batch axes
  valid_rows: dict | None  # the validation set, int32 [R, seq_len] each (``train/run/evaluation.py``)
  eval_step: Any
  steps_per_epoch: int | None  # sft: data: steps of one pass over its rows (None for token data)
  examples: int | None  # sft: data: examples consumed before the start (None: not recorded)


@dataclasses.dataclass
class Run:
  """A run, set up: what :func:`train` and ``train.grpo`` step through."""
  cfg: Config
  model_cfg: models.GPTConfig
  mesh: jax.sharding.Mesh
  par: models.Parallelism
  directory: rundir.RunDirectory
  checkpoints: ckpt_lib.Checkpoints
  record: dict  # config.json's, saved with each checkpoint
  state: step_lib.TrainState
  start_step: int
  train_step: Any
  data: Any  # train.gpt: Batches; train.grpo: its prompts, rewards and sampler
  trackers: list = dataclasses.field(default_factory=list)  # TensorBoard, W&B (``train/store/tracking.py``)


def setup(cfg: Config) -> Run:
  """The run of ``cfg`` (module docstring)."""
  directory, start_step = check_directory(cfg)
  mesh = make_mesh(cfg.mesh or f"fs={len(jax.devices())}")
  accum = trainer.batch_split(cfg, mesh)
  tokenizer = hf_io.load_tokenizer(hf_io.tokenizer_dir(cfg.run_path, cfg.init_from))
  eod = tokenizer.eod if cfg.document_mask else None
  source, valid_source = _sources(cfg, tokenizer)
  model_cfg = trainer.model_config(cfg, cfg.vocab_size or source.vocab_size)
  trainer.check_model(cfg, model_cfg, mesh)
  preflight.check_data(cfg, model_cfg, source, valid_source, eod)
  par = trainer.parallelism(cfg, mesh, accum)
  with jax.set_mesh(mesh):
    if cfg.hf_dir is not None and not cfg.resume:
      graphdef, params = hf_io.load(cfg.hf_dir, model_cfg, par)
    else:
      graphdef, params = models.init(model_cfg, par, cfg.seed)
    state, train_step = trainer.make_trainer(cfg, model_cfg, graphdef, params, par, accum)
    eval_step = step_lib.make_eval_step(graphdef, par, 1 if par.pp > 1 else accum)
  batches = _batches(cfg, model_cfg, mesh, source, valid_source, eod, eval_step)
  checkpoints = ckpt_lib.Checkpoints(cfg.ckpt_path, cfg.keep, create=False)  # made once checked
  state, meta, saved = trainer.resume_state(checkpoints, start_step, state, cfg, model_cfg, par)
  if meta is not None:
    batches.loader.set_state(meta["data"])
    batches = batches._replace(examples=meta.get("examples"))  # None: saved before examples were counted
  # The first batch compiles the step, read and put back.
  position = batches.loader.get_state()
  first = _global_batch(batches.sharding, (cfg.global_batch_size, model_cfg.seq_len), next(batches.loader))
  batches.loader.set_state(position)
  compiled = compile_within_memory(train_step, state, first, mesh, model_cfg)
  run = Run(cfg=cfg, model_cfg=model_cfg, mesh=mesh, par=par, directory=directory, checkpoints=checkpoints,
            record=config_record(cfg, model_cfg), state=state, start_step=start_step, train_step=train_step,
            data=batches)
  describe_communication(run, compiled)
  if jax.process_index() == 0:
    start_trackers(run)
    open_directory(run)
    if cfg.hf_dir is not None and os.path.isdir(cfg.hf_dir):
      hf_io.copy_tokenizer(cfg.hf_dir, cfg.run_path)
    if saved is not None:
      preflight.schedule_warning(cfg, saved["train"])
  return run


def check_directory(cfg: Config) -> tuple[rundir.RunDirectory, int]:
  """The run's directory, checked (``RunDirectory.check``; its lock and whether it is usable
  by process 0 only), and the step the run starts after."""
  directory = rundir.RunDirectory(cfg.run_path, cfg.ckpt_path)
  return directory, directory.check(cfg.resume, cfg.step, cfg.steps, primary=jax.process_index() == 0)


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


def _sources(cfg: Config, tokenizer) -> tuple[Any, Any]:
  source = data.load_source(cfg.data_spec, progress=jax.process_index() == 0, tokenizer=tokenizer,
                            packed=cfg.pack)
  valid_source = (data.load_source(cfg.valid_spec, progress=False, tokenizer=tokenizer, packed=cfg.pack)
                  if cfg.valid_spec else None)
  if cfg.vocab_size is None and source.vocab_size is None and cfg.hf_dir is None:
    raise UsageError(f"--data {' '.join(cfg.data)} does not record its vocabulary size; pass"
                     " --vocab-size (e.g. 50257 for GPT-2 tokens)")
  return source, valid_source


def _batches(cfg: Config, model_cfg: models.GPTConfig, mesh: jax.sharding.Mesh, source, valid_source,
             eod: int | None, eval_step) -> Batches:
  valid_rows = None
  if valid_source is not None and cfg.eval_tokens > 0:
    # Fine-tuning data is evaluated whole, as train.eval evaluates it; token data up to --eval-tokens.
    limit = None if isinstance(valid_source, data.SFTSource) else max(1, cfg.eval_tokens // model_cfg.seq_len)
    valid_rows = data.ordered_rows(valid_source, seq_len=model_cfg.seq_len, limit=limit, eod=eod)
  steps_per_epoch = None
  if isinstance(source, data.SFTSource):
    steps_per_epoch = len(data.make_dataset(source, seq_len=model_cfg.seq_len,
                                            global_batch_size=cfg.global_batch_size, num_epochs=1))
  sharding = NamedSharding(mesh, P(models.BATCH_AXES))
  shard = data.process_batch_shard(sharding, (cfg.global_batch_size, model_cfg.seq_len))
  loader = data.make_loader(source, seq_len=model_cfg.seq_len, global_batch_size=cfg.global_batch_size,
                            seed=cfg.seed, shard_index=shard[0], shard_count=shard[1], eod=eod)
  return Batches(loader, sharding, valid_rows, eval_step, steps_per_epoch, 0)


def compile_within_memory(train_step, state: Any, batch: dict, mesh: jax.sharding.Mesh,
                          model_cfg: models.GPTConfig) -> jax.stages.Compiled:
  """Compiles the step for ``state`` and ``batch`` (later calls reuse the executable) and
  refuses one whose memory the devices cannot hold (``preflight.check_memory``), before
  anything is written."""
  primary = jax.process_index() == 0
  if primary:
    print("compiling the training step", flush=True)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = train_step.lower(state, batch).compile()
  preflight.check_memory(compiled.memory_analysis(), mesh, model_cfg)
  if primary:
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s", flush=True)
  return compiled


def config_record(cfg: Config, model_cfg: models.GPTConfig, hf_config: dict | None = None) -> dict:
  """config.json's record: the flags and the model; with ``--init-from hf:DIR`` DIR's
  config.json (``hf_config``, or read from DIR), which train.export writes back even if the
  directory goes."""
  train = dataclasses.replace(cfg, run_dir=cfg.run_path,
                              ckpt_dir=cfg.ckpt_path if cfg.ckpt_dir else None).to_json()
  record = {"train": train, "model": dataclasses.asdict(model_cfg)}
  if cfg.hf_dir is not None:
    record["hf_config"] = hf_config or hf_io.read_config(cfg.hf_dir)
  return record


def describe_communication(run: Run, compiled: jax.stages.Compiled) -> None:
  """What the compiled step sends (``train/run/comm.py``), in the run's record (config.json's
  ``"communication"``) and, by process 0, one log line per group of mesh axes."""
  params = run.state.params
  run.record["communication"] = comm.describe(compiled, run.mesh, run.cfg, params, models.param_specs(params))
  if jax.process_index() == 0:
    print("\n".join(comm.lines(run.record["communication"], run.mesh)), flush=True)


def start_trackers(run: Run) -> None:
  """Process 0 starts the run's trackers (``--tensorboard``, ``--wandb``), before the
  directory is written: one that cannot start (W&B's login) is one error line."""
  run.trackers = tracking.start(run.cfg.run_path, run.record, run.cfg.tensorboard_path, run.cfg.wandb)


def open_directory(run: Run) -> None:
  """Process 0 takes the run's directory (``RunDirectory.open``: lock, config.json, the
  checkpoints past a ``--step`` back deleted, which the manager then forgets)."""
  if run.directory.open(run.record, run.start_step):
    run.checkpoints.manager.reload()


def global_batch(run: Run, local: dict) -> dict:
  """This process's rows of a batch (the loader's output) as one global array per key."""
  return _global_batch(run.data.sharding, (run.cfg.global_batch_size, run.model_cfg.seq_len), local)


def _global_batch(sharding: NamedSharding, shape: tuple[int, int], local: dict) -> dict:
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), shape) for k, v in local.items()}


def evaluate(run: Run, state: step_lib.TrainState) -> tuple[float, int]:
  """The validation loss (``train/run/evaluation.py``: the mean over every counted target of
  the validation rows, each row once) and the targets it counted."""
  with jax.set_mesh(run.mesh):
    return evaluation.mean_loss(run.data.eval_step, state.params, run.data.valid_rows, run.cfg.global_batch_size,
                                run.data.sharding)


# Examples in a global batch of packed rows: each row's last segment id is its count.
count_examples = jax.jit(lambda segment_ids_BxT: jnp.sum(jnp.max(segment_ids_BxT, axis=1)))


def save(run: Run, step: int, state: step_lib.TrainState, meta: dict) -> None:
  """Starts the background save of checkpoint ``step``: ``state`` and ``meta`` (JSON) with
  the run's record."""
  with jax.set_mesh(run.mesh):
    tree = ckpt_lib.to_saved(state, run.par.pp, run.par.virtual_stages)
  run.checkpoints.save(step, tree, {"step": step, **meta}, run.record)


@dataclasses.dataclass
class Progress:
  """Where a run's loop stands: what :func:`run_loop` judges its end by."""
  step: int  # the last step begun
  state: step_lib.TrainState
  skipped_in_a_row: int = 0  # optimizer updates
  diverged: int = 0  # the skipped updates in a row that reached --max-skipped (0: not reached)
  signum: int = 0  # the signal every process agreed to stop on (0: none)

  def count(self, skipped: bool, max_skipped: int) -> None:
    """Counts an update, skipped or applied; once ``max_skipped`` in a row were skipped the
    run has diverged, whatever the updates read after them."""
    self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
    if not self.diverged and self.skipped_in_a_row >= max_skipped:
      self.diverged = self.skipped_in_a_row


def run_loop(run: Run, steps: Callable[[Progress, Interrupt], None]) -> int:
  """Runs ``steps(progress, interrupt)``, the loop, holding the run's directory until it
  returns, and its end as an exit code: 0 done, 1 a checkpoint failed to save, the
  device ran out of memory or another process was lost (``train/run/peers.py``), 3 diverged (``--max-skipped`` updates in a row skipped, or a
  state that ends non-finite), 130 / 143 stopped by SIGINT / SIGTERM (``train/run/interrupt.py``),
  each but 0 with one ``error: ...`` line."""
  progress = Progress(run.start_step, run.state)
  start = time.perf_counter()
  with peers.together(run.directory.close):  # several processes: an error in one, or a lost one, ends all
    try:
      with Interrupt(run.directory.close) as interrupt:
        try:
          steps(progress, interrupt)
          run.checkpoints.close()
        except ckpt_lib.SaveError as e:
          return peers.fail(str(e), EXIT_FAILED)
        except jax.errors.JaxRuntimeError as e:
          # A step that failed to allocate raises RESOURCE_EXHAUSTED; what waited on its output
          # (the agreement, a step later) raises INTERNAL with the same "Out of memory".
          if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
            raise
          return peers.fail(f"out of device memory by step {progress.step} ({str(e).splitlines()[0][:160]});"
                            f" {_kept(run)}; lower --micro-batch-size or --seq-len, add --remat, or shard over"
                            " more devices (--mesh)", EXIT_FAILED)
        return _exit_code(run, progress, interrupt, time.perf_counter() - start)
    finally:
      run.directory.close()


def _kept(run: Run) -> str:
  saved = run.checkpoints.saving or run.start_step
  return f"the checkpoint of step {saved} is in {run.cfg.ckpt_path}" if saved else "no checkpoint was written"


def _exit_code(run: Run, progress: Progress, interrupt: Interrupt, seconds: float) -> int:
  cfg, step = run.cfg, progress.step
  if progress.signum:
    where = "" if interrupt.signum == progress.signum else " sent to another process"
    print(f"error: stopped by {signal.Signals(progress.signum).name}{where} after step {step}; the checkpoint"
          f" of step {run.checkpoints.saving or run.start_step} is saved in {cfg.ckpt_path}; continue with"
          " --resume", file=sys.stderr)
    return 128 + progress.signum
  if progress.diverged:
    saved = run.checkpoints.saving or run.start_step
    kept = f"the last good checkpoint is step {saved} in {cfg.ckpt_path}" if saved else "no checkpoint was written"
    spiking = " or a spiking loss or gradient norm (--skip-spikes)" if cfg.skip_spikes else ""
    print(f"error: stopped after {progress.diverged} consecutive iterations with a non-finite loss,"
          f" gradient or update{spiking} (--max-skipped {cfg.max_skipped}); {kept}; lower --lr, raise"
          " --lr-warmup-steps or check the data", file=sys.stderr)
    return EXIT_DIVERGED
  if not jax.jit(step_lib.all_finite)(progress.state.params, progress.state.opt_state):
    # The step's guard keeps a finite state finite, so this one started non-finite.
    origin = (f"as in the checkpoint of step {run.start_step} in {cfg.ckpt_path} it resumed from"
              if run.start_step else "from the initialization")
    print(f"error: the parameters or optimizer state are not finite at the end of the run,"
          f" {origin}, and every step on them is skipped; resume from an earlier checkpoint or"
          " start a new --run-dir", file=sys.stderr)
    return EXIT_DIVERGED
  if jax.process_index() == 0:
    print(f"done: {cfg.steps - run.start_step} steps in {seconds:.1f} s", flush=True)
  return 0


def train(run: Run) -> int:
  """Runs ``python -m train.gpt``'s steps (:func:`run_loop`): each a global batch from the
  loader through the jitted step; evaluations every ``--eval-every`` steps, checkpoints every
  ``--save-every``, a log line every ``--log-interval`` (``train/store/log.py``)."""
  return run_loop(run, lambda progress, interrupt: _steps(run, progress, interrupt))


def _steps(run: Run, progress: Progress, interrupt: Interrupt) -> None:
  cfg, batches = run.cfg, run.data
  logger = Logger(cfg.run_path, cfg.steps, cfg.global_batch_size * run.model_cfg.seq_len,
                  run.model_cfg.flops_per_token(), run.mesh.size, jax.devices()[0].device_kind,
                  jax.process_index() == 0, batches.steps_per_epoch, batches.examples, run.trackers)
  profile = profiling.Steps(cfg.profile_range, profiling.directory(cfg.run_path))
  logger.message(f"training {cfg.init_from or cfg.preset} ({run.model_cfg.num_params() / 1e6:.2f}M parameters,"
                 f" {run.model_cfg.dtype}) with {cfg.optimizer} on mesh {format_mesh_spec(dict(run.mesh.shape))}"
                 f" ({jax.process_count()} process(es)), steps {run.start_step + 1}..{cfg.steps},"
                 f" run directory {cfg.run_path}")
  if cfg.ignored_flags():
    logger.message(f"warning: --optimizer {cfg.optimizer} does not read {', '.join(cfg.ignored_flags())};"
                   " they are recorded in config.json but change nothing")
  pending = None  # the previous step's metrics, read while the next step runs
  scaled = run.model_cfg.dtype == "float16"

  def account(step: int, metrics: step_lib.StepMetrics, examples: jax.Array | None) -> None:
    m = jax.device_get(metrics)
    logger.step(float(m.loss - m.router_loss), float(m.grad_norm), float(m.learning_rate), bool(m.skipped),
                float(m.loss_scale) if scaled else None,
                None if cfg.qk_clip_threshold is None else (float(m.max_logit), int(m.clipped_heads)),
                (float(m.router_loss), float(m.expert_load), float(m.dropped)) if run.model_cfg.num_experts else None,
                None if examples is None else int(examples), bool(m.spike) if cfg.skip_spikes else None)
    progress.count(bool(m.skipped), cfg.max_skipped)
    peers.progress(step)
    if step % cfg.log_interval == 0 or step == cfg.steps:
      logger.flush(step)

  agreement = Agreement(run.mesh)
  try:
    for step in range(run.start_step + 1, cfg.steps + 1):
      progress.step = step
      with jax.set_mesh(run.mesh), profile.step(step):
        batch = global_batch(run, next(batches.loader))
        progress.state, metrics = run.train_step(progress.state, batch)
        examples = count_examples(batch["segment_ids"]) if batches.steps_per_epoch else None
      profile.after(step, progress.state)
      run.checkpoints.check_for_errors()
      stop = agreement(interrupt.signum or 0, metrics.loss)  # a signal to any process stops all after this step
      if pending is not None:
        account(*pending)
      pending = (step, metrics, examples)
      if progress.diverged:
        break
      is_last = step == cfg.steps
      evaluating = batches.valid_rows is not None and (is_last or (cfg.eval_every and step % cfg.eval_every == 0))
      saving = is_last or stop or (cfg.save_every and step % cfg.save_every == 0)
      if evaluating or saving:
        account(*pending)
        pending = None
        if progress.diverged:
          break
      if evaluating:
        t0 = time.perf_counter()
        loss, targets = evaluate(run, progress.state)
        logger.validation(step, loss, targets, time.perf_counter() - t0)
      if saving:
        save(run, step, progress.state, {"data": batches.loader.get_state(), "examples": logger.examples})
        logger.message(f"saving the checkpoint of step {step} to {cfg.ckpt_path} (in the background)")
      if stop:
        break
    if pending is not None:
      account(*pending)
    progress.signum = agreement.latest()
  finally:
    profile.close()
    logger.close()
