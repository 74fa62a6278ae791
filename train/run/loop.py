"""A training run, stepped: :func:`train` runs ``python -m train.gpt``'s steps in
:func:`run_loop`, which holds the run's directory and turns the loop's end into an exit
code, as it does for GRPO's loop (``train/grpo/loop.py``). The run is
``train/run/setup.py``'s.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from dion_jax.parallel import format_mesh_spec
from train.run import agent, evaluation, peers
from train.run import grad_norm as grad_norm_lib
from train.run import step as step_lib
from train.run.interrupt import Agreement, Interrupt
from train.run.setup import Run
from train.store import checkpoint as ckpt_lib
from train.store import log, profiling
from train.store.log import Logger

EXIT_FAILED = 1
EXIT_DIVERGED = 3


def global_batch(run: Run, local: dict) -> dict:
  """This process's rows of a batch (the loader's output) as one global array per key."""
  return run.data.to_global(local)


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
  evaluated: bool = False  # whether a validation ran (and compiled its step)

  def count(self, skipped: bool, max_skipped: int) -> None:
    """Counts an update, skipped or applied; once ``max_skipped`` in a row were skipped the
    run has diverged, whatever the updates read after them."""
    self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
    if not self.diverged and self.skipped_in_a_row >= max_skipped:
      self.diverged = self.skipped_in_a_row


def run_loop(run: Run, steps: Callable[[Progress, Interrupt], None], done_before: float = 0.0,
             command: str = "train.gpt") -> int:
  """Runs ``steps(progress, interrupt)``, the loop, holding the run's directory until it
  returns, and its end as an exit code (``done_before``: seconds of the first step spent in
  set-up, GRPO's first rollout, which the last line counts; ``command``, ``python -m
  COMMAND``, the one a signal's line says to resume with): 0 done, 1 a checkpoint failed to save, the
  device ran out of memory or another process was lost (``train/run/peers.py``), 3 diverged (``--max-skipped`` updates in a row skipped, or a
  state that ends non-finite), 130 / 143 stopped by SIGINT / SIGTERM (``train/run/interrupt.py``),
  each but 0 with one ``error: ...`` line."""
  progress = Progress(run.start_step, run.state)
  start = time.perf_counter() - done_before
  with peers.together(run.directory.close):  # several processes: an error in one, or a lost one, ends all
    try:
      with Interrupt(run.directory.close) as interrupt:
        try:
          steps(progress, interrupt)
          run.checkpoints.close()
        except ckpt_lib.SaveError as e:
          return peers.fail(str(e), EXIT_FAILED, maybe_lost=e.no_os_error)
        except jax.errors.JaxRuntimeError as e:
          # A step that failed to allocate raises RESOURCE_EXHAUSTED; what waited on its output
          # (the agreement, a step later) raises INTERNAL with the same "Out of memory".
          if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
            raise
          return peers.fail(f"out of device memory by step {progress.step} ({str(e).splitlines()[0][:160]});"
                            f" {_kept(run)}; lower --micro-batch-size or --seq-len, add --remat, or shard over"
                            " more devices (--mesh)", EXIT_FAILED)
        return _exit_code(run, progress, interrupt, time.perf_counter() - start, command)
    finally:
      run.directory.close()


def _kept(run: Run) -> str:
  saved = run.checkpoints.saving or run.start_step
  return f"the checkpoint of step {saved} is in {run.cfg.ckpt_path}" if saved else "no checkpoint was written"


def _exit_code(run: Run, progress: Progress, interrupt: Interrupt, seconds: float, command: str) -> int:
  cfg, step = run.cfg, progress.step
  if progress.signum:
    where = "" if interrupt.signum == progress.signum else " sent to another process"
    print(f"error: stopped by {signal.Signals(progress.signum).name}{where} after step {step}; the checkpoint"
          f" of step {run.checkpoints.saving or run.start_step} is saved in {cfg.ckpt_path}; continue with:"
          f" {agent.resume_command(cfg, command)}", file=sys.stderr)
    return 128 + progress.signum
  if progress.diverged:
    saved = run.checkpoints.saving or run.start_step
    kept = f"the last good checkpoint is step {saved} in {cfg.ckpt_path}" if saved else "no checkpoint was written"
    spiking = " or a spiking loss or gradient norm (--skip-spikes)" if cfg.skip_spikes else ""
    print(f"error: stopped after {progress.diverged} consecutive iterations with a non-finite loss,"
          f" gradient or update{spiking} (--max-skipped {cfg.max_skipped}); {kept}; lower --lr, raise"
          " --lr-warmup-steps or check the data", file=sys.stderr)
    return EXIT_DIVERGED
  if not jax.jit(lambda p, o: step_lib.all_finite(p, step_lib.on_device(o)))(progress.state.params,
                                                                               progress.state.opt_state):
    # The step's guard keeps a finite state finite, so this one started non-finite.
    origin = (f"as in the checkpoint of step {run.start_step} in {cfg.ckpt_path} it resumed from"
              if run.start_step else "from the initialization")
    print(f"error: the parameters or optimizer state are not finite at the end of the run,"
          f" {origin}, and every step on them is skipped; resume from an earlier checkpoint or"
          " start a new --run-dir", file=sys.stderr)
    return EXIT_DIVERGED
  if jax.process_index() == 0:
    print(f"done: {log.counted(cfg.steps - run.start_step, 'step')} in {seconds:.1f} s", flush=True)
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
                  jax.process_index() == 0, batches.steps_per_epoch, batches.examples, run.trackers,
                  grad_norm_lib.LOG_NAMES[run.record["grad_norm"]])
  profile = profiling.Steps(cfg.profile_range, profiling.directory(cfg.run_path))
  logger.message(f"training {cfg.init_from or cfg.preset} ({run.model_cfg.num_params() / 1e6:.2f}M parameters,"
                 f" {run.model_cfg.dtype}) with {cfg.optimizer} on mesh {format_mesh_spec(dict(run.mesh.shape))}"
                 f" ({log.processes(jax.process_count())}),"
                 f" steps {run.start_step + 1}..{cfg.steps}, run directory {cfg.run_path}")
  logger.legend(cfg.clip_grad)
  if ignored := cfg.ignored_flags():
    logger.message(f"warning: --optimizer {cfg.optimizer} does not read {', '.join(ignored)};"
                   f" {'they are' if len(ignored) > 1 else 'it is'} recorded in config.json but change"
                   f"{'' if len(ignored) > 1 else 's'} nothing")
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
    if step % cfg.log_interval == 0 or step == cfg.steps or step == run.start_step + 1:  # the first as it ends
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
        if not progress.evaluated:  # the first compiles the evaluation step: say what is coming, as train.eval does
          rows = batches.valid_rows["inputs"]
          logger.message(f"validating at iteration {step}: {len(rows)} rows of {rows.shape[1]} tokens,"
                         f" {cfg.global_batch_size} a pass (compiling the evaluation step first)")
          progress.evaluated = True
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
