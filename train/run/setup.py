"""A training run, set up: ``python -m train.gpt``'s, and the steps ``python -m train.grpo``
shares with it.

:func:`setup` reads as its steps: check the run directory, make the mesh, resolve the
model's source (``train/run/model_source.py``), load the data, make the model and the
trainer (optimizer and jitted step, ``train/run/trainer.py``), resume its state, compile
the step within the devices' memory, then take the directory. Each check raises
``UsageError`` / ``ValueError`` with one line that names the problem and the fix, before
anything is written. The run's steps are ``train/run/loop.py``'s.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import data
import dion_jax
import models
from dion_jax.parallel import format_mesh_spec
from train.cli import UsageError
from train.run import comm, evaluation, optim, preflight, trainer
from train.run import grad_norm as grad_norm_lib
from train.run import model_source as model_source_lib
from train.run import step as step_lib
from train.run.plan import grpo as plan_grpo
from train.run.config import Config
from train.store import checkpoint as ckpt_lib
from train.store import rundir, tracking


class Batches(NamedTuple):
  """train.gpt's data: the loader of this process's rows and what evaluates and counts them."""
  loader: Any  # grain iterator of this process's rows, its position checkpointed
  sharding: NamedSharding  # a global batch's, over the batch axes
  shape: tuple[int, int]  # a global batch's [sequences, seq_len]
  valid_rows: dict | None  # the validation set, int32 [R, seq_len] each (``train/run/evaluation.py``)
  eval_step: Any
  steps_per_epoch: int | None  # sft: data: steps of one pass over its rows (None for token data)
  examples: int | None  # sft: data: examples consumed before the start (None: not recorded)

  def to_global(self, local: dict) -> dict:
    """This process's rows of a batch (the loader's output) as one global array per key."""
    return {k: jax.make_array_from_process_local_data(self.sharding, np.asarray(v), self.shape)
            for k, v in local.items()}


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
  par, accum = trainer.parallelism(cfg, mesh)
  origin = model_source_lib.resolve(cfg.init_from, cfg.preset, cfg.run_path)
  eod = origin.tokenizer.eod if cfg.document_mask else None
  source, valid_source = _sources(cfg, origin)
  model_cfg = origin.model_config(cfg, cfg.vocab_size or source.vocab_size)
  preflight.check_model(cfg, model_cfg, mesh)
  preflight.check_data(cfg, model_cfg, source, valid_source, eod, origin.imported)
  checkpoints = ckpt_lib.Checkpoints(cfg.ckpt_path, cfg.keep, create=False)  # made once checked
  if start_step:  # a checkpoint of another model or optimizer is refused before the model is built
    trainer.checkpoint_record(checkpoints, start_step, cfg, model_cfg)
  with jax.set_mesh(mesh):
    graphdef, params = origin.init(model_cfg, par, cfg.seed, resuming=cfg.resume)
    state, train_step = trainer.make_trainer(cfg, model_cfg, graphdef, params, par, accum)
    eval_step = step_lib.make_eval_step(models.fp8.inference_graphdef(graphdef, model_cfg), par,
                                        1 if par.pp > 1 else accum)
  batches = _batches(cfg, model_cfg, mesh, source, valid_source, eod, eval_step)
  state, meta, saved = trainer.resume_state(checkpoints, start_step, state, cfg, model_cfg, par)
  if saved is not None:  # after the checkpoint's model and optimizer are checked, before the compile
    preflight.check_schedule(cfg, start_step, saved["train"])
  if meta is not None:
    batches.loader.set_state(meta["data"])
    batches = batches._replace(examples=meta.get("examples"))  # None: saved before examples were counted
  # The first batch compiles the step, read and put back.
  position = batches.loader.get_state()
  first = batches.to_global(next(batches.loader))
  batches.loader.set_state(position)
  compiled = compile_within_memory(train_step, state, first, mesh, model_cfg, cfg)
  run = Run(cfg=cfg, model_cfg=model_cfg, mesh=mesh, par=par, directory=directory, checkpoints=checkpoints,
            record=config_record(cfg, model_cfg, origin), state=state, start_step=start_step,
            train_step=train_step, data=batches)
  describe_communication(run, compiled)
  if jax.process_index() == 0:
    start_trackers(run)
    open_directory(run)
    origin.keep_tokenizer(cfg.run_path)
    if saved is not None:
      preflight.schedule_warning(cfg, saved["train"], start_step)
  return run


def check_directory(cfg: Config) -> tuple[rundir.RunDirectory, int]:
  """The run's directory, checked (``RunDirectory.check``; its lock and whether it is usable
  by process 0 only), and the step the run starts after."""
  ckpt_lib.quiet_orbax_logs()
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


def _sources(cfg: Config, origin: model_source_lib.ModelSource) -> tuple[Any, Any]:
  source = data.load_source(cfg.data_spec, progress=jax.process_index() == 0, tokenizer=origin.tokenizer,
                            packed=cfg.pack)
  valid_source = (data.load_source(cfg.valid_spec, progress=False, tokenizer=origin.tokenizer, packed=cfg.pack)
                  if cfg.valid_spec else None)
  if cfg.vocab_size is None and source.vocab_size is None and not origin.imported:
    raise UsageError(f"--data {' '.join(cfg.data)} does not record its vocabulary size; pass"
                     " --vocab-size (e.g. 50257 for GPT-2 tokens)")
  return source, valid_source


def _batches(cfg: Config, model_cfg: models.GPTConfig, mesh: jax.sharding.Mesh, source, valid_source,
             eod: int | None, eval_step) -> Batches:
  valid_rows = None
  if valid_source is not None and cfg.eval_tokens > 0:
    valid_rows = evaluation.rows(valid_source, model_cfg.seq_len, cfg.eval_tokens, eod)
  steps_per_epoch = None
  sharding = NamedSharding(mesh, P(models.BATCH_AXES))
  shard = data.process_batch_shard(sharding, (cfg.global_batch_size, model_cfg.seq_len))
  try:
    if isinstance(source, data.SFTSource):
      steps_per_epoch = len(data.make_dataset(source, seq_len=model_cfg.seq_len,
                                              global_batch_size=cfg.global_batch_size, num_epochs=1))
    loader = data.make_loader(source, seq_len=model_cfg.seq_len, global_batch_size=cfg.global_batch_size,
                              seed=cfg.seed, shard_index=shard[0], shard_count=shard[1], eod=eod)
  except data.DataError as e:
    raise UsageError(f"--data {e}; pass more data, or a smaller --global-batch-size or --seq-len") from None
  return Batches(loader, sharding, (cfg.global_batch_size, model_cfg.seq_len), valid_rows, eval_step, steps_per_epoch, 0)


def compile_within_memory(train_step, state: Any, batch: dict, mesh: jax.sharding.Mesh,
                          model_cfg: models.GPTConfig, cfg: Config | None = None,
                          grpo: plan_grpo.GRPO | None = None) -> jax.stages.Compiled:
  """Compiles the step for ``state`` and ``batch`` (later calls reuse the executable) and
  refuses one whose memory the devices cannot hold (``preflight.check_memory``), before
  anything is written."""
  primary = jax.process_index() == 0
  if primary:
    print("compiling the training step", flush=True)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = train_step.lower(state, batch).compile()
  preflight.check_memory(compiled.memory_analysis(), mesh, model_cfg, cfg, grpo)
  if primary:
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s", flush=True)
  return compiled


def config_record(cfg: Config, model_cfg: models.GPTConfig, origin: model_source_lib.ModelSource) -> dict:
  """config.json's record: the flags, the model and what it keeps of the model's source
  (``ModelSource.record``)."""
  train = dataclasses.replace(cfg, run_dir=cfg.run_path,
                              ckpt_dir=cfg.ckpt_path if cfg.ckpt_dir else None).to_json()
  return {"train": train, "model": dataclasses.asdict(model_cfg), **origin.record()}


def describe_communication(run: Run, compiled: jax.stages.Compiled) -> None:
  """What the compiled step sends (``train/run/comm.py``), in the run's record (config.json's
  ``"communication"``) and, by process 0, one log line per group of mesh axes; and the
  gradient norm it clips by and logs (``"grad_norm"``: ``train/run/grad_norm.py``'s sketch,
  rms or exact, the last wherever no gradient is per replica)."""
  params = run.state.params
  run.record["grad_norm"] = grad_norm_lib.shown(run.cfg.grad_norm, optim.per_replica_mask(run.cfg, params, run.mesh))
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
