"""GRPO's run: its set-up on the trainer's (``train.run.setup``) with GRPO's own model, prompts
and objective, and its steps in the trainer's loop (``train.run.loop``): a rollout
(``train/grpo/rollout.py``), then ``--updates-per-rollout`` updates on it."""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import data
import models
from data import prompts as prompts_lib
from dion_jax.parallel import format_mesh_spec
from train import cli
from train.cli import UsageError
from train.grpo import config as grpo_config
from train.grpo import objective as grpo_objective
from train.grpo import rewards as grpo_rewards
from train.grpo import rollout as rollout_lib
from train.grpo.config import GRPOConfig
from train.run import config as config_lib
from train.run import loop, peers, preflight, trainer
from train.run import model_source as model_source_lib
from train.run.plan import grpo as plan_grpo
from train.run import setup as setup_lib
from train.run.setup import Run
from train.run import restore as restore_lib
from train.run import step as step_lib
from train.run.interrupt import Agreement, Interrupt
from train.store import checkpoint as ckpt_lib
from train.store import log, rundir



def read_prompts(grpo: GRPOConfig, tokenizer, limit: int) -> tuple[list[dict], list[str], list[np.ndarray]]:
  """The rows of ``--prompts``, their prompt texts and tokens; each prompt 1 to ``limit`` tokens."""
  try:
    rows = prompts_lib.read_rows(grpo.prompts)
  except data.DataError as e:
    raise UsageError(f"--prompts {e}") from None
  texts, tokens = [], []
  for number, row in enumerate(rows, 1):
    where = f"--prompts {grpo.prompts} row {number}"
    if isinstance(row.get(grpo.prompt_column), str):
      text = row[grpo.prompt_column]
      ids = tokenizer.encode(text)
    elif "messages" in row:
      if tokenizer.chat is None:
        raise UsageError(f"{where}: chat messages need a tokenizer with a chat template (a run started"
                         " from --init-from hf:DIR)")
      text = tokenizer.chat.render(row["messages"], add_generation_prompt=True)
      ids = tokenizer.encode(text, special=False)
    else:
      raise UsageError(f"{where} has no --prompt-column {grpo.prompt_column!r} text nor chat \"messages\""
                       f" (its columns: {', '.join(row)}); pass --prompt-column NAME")
    if "answer" in (r.partition("=")[0] for r in grpo.reward) and grpo.answer_column not in row:
      raise UsageError(f"{where} has no --answer-column {grpo.answer_column!r}, which --reward answer reads"
                       f" (its columns: {', '.join(row)}); pass --answer-column NAME")
    if not 1 <= len(ids) <= limit:
      raise UsageError(f"{where}: the prompt has {len(ids)} tokens; it must have 1 to {limit} (the"
                       " model's seq_len less --max-new-tokens)")
    texts.append(text)
    tokens.append(np.asarray(ids, np.int32))
  return rows, texts, tokens


def _data_parallel(mesh: jax.sharding.Mesh) -> int:
  sizes = dict(mesh.shape)
  return sizes["rp"] * sizes["fs"] * sizes["ep"]


def _check_split(grpo: GRPOConfig, mesh: jax.sharding.Mesh) -> None:
  sizes, dp = dict(mesh.shape), _data_parallel(mesh)
  if grpo.rollout_size % (dp * sizes["pp"]):
    raise UsageError(f"--mesh {format_mesh_spec(sizes)}: the {grpo.rollout_size} completions of a step"
                     f" (--prompts-per-step x --group-size) split over {dp} data-parallel ranks (rp x fs x ep)"
                     f" and into pp={sizes['pp']} micro-batches on each; choose sizes whose product"
                     f" {dp * sizes['pp']} divides")


def setup(grpo: GRPOConfig, cfg: config_lib.Config) -> Run:
  """The run of ``grpo`` and ``cfg`` (``train/grpo/config.py``; JAX started for its mesh):
  ``train.run.setup.setup``'s steps, with GRPO's own model (the starting policy), data (the
  prompts and rewards) and objective; the first rollout compiles the step."""
  directory, start_step = setup_lib.check_directory(cfg)
  mesh = setup_lib.make_mesh(cfg.mesh or f"fs={len(jax.devices())}")
  _check_split(grpo, mesh)
  par, accum = trainer.parallelism(cfg, mesh)
  origin = model_source_lib.resolve(grpo.init_from)
  starting, model_cfg, graphdef = _starting_policy(grpo, cfg, par, origin)
  prompts = _prompts(grpo, model_cfg, graphdef, starting, origin.tokenizer, _data_parallel(mesh) * accum)
  with jax.set_mesh(mesh):
    state, train_step = trainer.make_trainer(cfg, model_cfg, graphdef, starting.params, par, accum,
                                             functools.partial(grpo_objective.weighted, prompts.objective),
                                             grpo.temperature)
  checkpoints = ckpt_lib.Checkpoints(cfg.ckpt_path, cfg.keep, create=False)  # made once checked
  state, meta, _ = trainer.resume_state(checkpoints, start_step, state, cfg, model_cfg, par)
  if meta and "entropy_control" in meta:
    saved = meta["entropy_control"]
    prompts = prompts._replace(entropy_control=grpo_objective.EntropyControl(
        saved["coef"], math.inf if saved["entropy"] is None else saved["entropy"]))
  record = {**setup_lib.config_record(cfg, model_cfg, origin),
            "grpo": dataclasses.asdict(grpo), "init_step": starting.step}
  run = setup_lib.Run(cfg=cfg, model_cfg=model_cfg, mesh=mesh, par=par, directory=directory, checkpoints=checkpoints,
                 record=record, state=state, start_step=start_step, train_step=train_step, data=prompts)
  if jax.process_index() == 0:
    print(f"sampling the first rollout ({grpo.prompts_per_step} prompts x {grpo.group_size} completions of up to"
          f" {grpo.max_new_tokens} tokens; compiling the sampler first)", flush=True)
  first = rollout_lib.rollout(run, state, start_step + 1)
  if jax.process_index() == 0:
    print(f"sampled the first rollout in {first.seconds:.1f} s (step {start_step + 1}'s)", flush=True)
  compiled = setup_lib.compile_within_memory(train_step, state, first.batch, mesh, model_cfg, cfg,
                                             update_shape(grpo, first.batch))
  setup_lib.describe_communication(run, compiled)
  run.data = prompts._replace(first=first)
  if jax.process_index() == 0:
    setup_lib.start_trackers(run)
    setup_lib.open_directory(run)
  return run


def update_shape(grpo: GRPOConfig, batch: dict) -> plan_grpo.GRPO:
  """The planner's shape of GRPO's update on ``batch`` (its rows' length, not the prompts')."""
  length = batch["inputs"].shape[1]
  return plan_grpo.GRPO(grpo.prompts_per_step, grpo.group_size, max(length - grpo.max_new_tokens, 1),
                        grpo.max_new_tokens, grpo.beta)


def _starting_policy(grpo: GRPOConfig, cfg: config_lib.Config, par: models.Parallelism,
                     origin: model_source_lib.ModelSource) -> tuple[restore_lib.Restored, models.GPTConfig, Any]:
  """The --init-from run's checkpoint (the one a resumed run started from) on ``par``'s
  mesh, and its model computing as the flags say (dtype, attention, remat)."""
  step = (rundir.saved_record(grpo.run_dir) or {}).get("init_step") if grpo.resume else None
  with jax.set_mesh(par.mesh):
    # A new run's --init-from takes the run's latest checkpoint, a resumed run's the step it
    # started from: no flag picks another (--step picks the resumed run's own).
    starting = origin.load(step, par, picks_step=preflight.RESUMED_START if grpo.resume else None)
  model_cfg = dataclasses.replace(starting.cfg, **model_source_lib.compute_settings(cfg))
  preflight.check_model(cfg, model_cfg, par.mesh)
  return starting, model_cfg, models.abstract(model_cfg, par)[0]


def _prompts(grpo: GRPOConfig, model_cfg: models.GPTConfig, graphdef: Any, starting: restore_lib.Restored,
             tokenizer, rows_unit: int) -> rollout_lib.Prompts:
  """GRPO's data: the prompts, the rewards, the objective, the reference (with --beta > 0)."""
  rewards = grpo_rewards.reward_functions(list(grpo.reward), grpo.answer_column)
  limit = model_cfg.seq_len - grpo.max_new_tokens
  if limit < 1:
    raise UsageError(f"--max-new-tokens {grpo.max_new_tokens} leaves no room for a prompt in the model's"
                     f" seq_len {model_cfg.seq_len} (--init-from {grpo.init_from}'s); pass a --max-new-tokens"
                     f" below {model_cfg.seq_len}")
  rows, texts, tokens = read_prompts(grpo, tokenizer, limit)
  objective = grpo_objective.Objective(
      **{f.name: getattr(grpo, f.name) for f in dataclasses.fields(grpo_config.ObjectiveConfig)},
      max_completion_length=grpo.max_new_tokens, sequences=grpo.rollout_size)
  # The step donates the policy's buffers: the reference keeps its own.
  reference = jax.tree.map(jnp.copy, starting.params) if grpo.beta > 0 else None
  return rollout_lib.Prompts(grpo, rows, texts, tokens, tokenizer, rewards, objective, graphdef, reference, None, rows_unit,
                 grpo_objective.EntropyControl(grpo.entropy_coef))

def train(run: Run) -> int:
  """The GRPO steps in ``loop.run_loop`` (its exit codes); a reward's bad output later in
  the run prints ``error: ...``, exit 2."""
  try:
    return loop.run_loop(run, lambda progress, interrupt: _steps(run, progress, interrupt), run.data.first.seconds,
                          "train.grpo")
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return cli.EXIT_USAGE


def _steps(run: Run, progress: loop.Progress, interrupt: Interrupt) -> None:
  cfg, grpo = run.cfg, run.data.grpo
  primary = jax.process_index() == 0
  metrics = run.directory.metrics(run.trackers) if primary else None
  if primary:
    print(f"GRPO on {grpo.init_from} ({run.model_cfg.num_params() / 1e6:.2f}M parameters, {run.model_cfg.dtype})"
          f" with {cfg.optimizer} on mesh {format_mesh_spec(dict(run.mesh.shape))} ({log.processes(jax.process_count())}), steps"
          f" {run.start_step + 1}..{grpo.steps}, run directory {cfg.run_path}", flush=True)
    print(LEGEND, flush=True)
  agreement = Agreement(run.mesh)
  made, control = run.data.first, run.data.entropy_control
  compiled_for = {made.batch["inputs"].shape}  # the step compiles again for each new shape of packed rows
  try:
    for step in range(run.start_step + 1, grpo.steps + 1):
      progress.step = step
      made = made if made is not None else rollout_lib.rollout(run, progress.state, step)
      rows, length = shape = made.batch["inputs"].shape
      if primary and shape not in compiled_for:
        print(f"step {step}: compiling the training step for {rows} rows of {length} tokens (the rollout's"
              " rows take a shape not seen before)", flush=True)
      compiled_for.add(shape)
      t0 = time.perf_counter()
      updates, control = _updates(run, progress, made, control)
      train_s = time.perf_counter() - t0
      record = _record(run, step, made, updates, train_s, control)
      if metrics is not None:
        metrics.write(record)
        print(_line(record, grpo.steps), flush=True)
      made = None
      peers.progress(step)
      run.checkpoints.check_for_errors()
      stop = agreement(interrupt.signum or 0, progress.state.updates)  # a signal to any process stops all after this step
      if progress.diverged:
        break
      if step == grpo.steps or stop or (cfg.save_every and step % cfg.save_every == 0):
        loop.save(run, step, progress.state, _meta(run, control))
      if stop:
        break
    progress.signum = agreement.latest()
  finally:
    if metrics is not None:
      metrics.close()


def _updates(run: Run, progress: loop.Progress, made: rollout_lib.Rollout, control: grpo_objective.EntropyControl
             ) -> tuple[list[step_lib.StepMetrics], grpo_objective.EntropyControl]:
  """``--updates-per-rollout`` steps on the rollout (each skipped one counted; TRL's
  ``num_iterations``); with the high-entropy mask each after the first takes it from the
  current policy, as TRL's; with the entropy bonus each applies ``control``'s coefficient
  and moves it by the entropy it measured (adaptive control)."""
  out = []
  batch, objective = made.batch, run.data.objective
  for update in range(run.data.grpo.updates_per_rollout):
    if update and "keep" in batch:
      _, keep_BxM, _ = rollout_lib.logps_and_keep(run, progress.state, made.layout, made.mask_BxM)
      batch = rollout_lib.update_batch(run, made, keep_BxM)
    with jax.set_mesh(run.mesh):
      if objective.entropy_bonus:
        batch = {**batch, "entropy_bonus": batch["entropy_weights"] * control.applied(objective)}
      progress.state, metrics = run.train_step(progress.state, batch)
    metrics = jax.device_get(metrics)
    out.append(metrics)
    control = control.after(float(metrics.objective_stats.entropy), objective)
    progress.count(bool(metrics.skipped), run.cfg.max_skipped)
    if progress.diverged:
      break
  return out, control


def _meta(run: Run, control: grpo_objective.EntropyControl) -> dict:
  """What a checkpoint keeps beside the state: the adaptive entropy bonus's control (its
  entropy null before the first measurement)."""
  if not run.data.objective.use_adaptive_entropy:
    return {}
  return {"entropy_control": {"coef": control.coef, "entropy": control.entropy if math.isfinite(control.entropy)
                              else None}}


def _record(run: Run, step: int, made: rollout_lib.Rollout, updates: list[step_lib.StepMetrics], train_s: float,
            control: grpo_objective.EntropyControl) -> dict:
  """Step ``step``'s metrics.jsonl record; the updates' numbers are means over them."""
  rewards, grpo = run.data.rewards, run.data.grpo
  total_B = made.rewards_BxR @ np.asarray([w for _, _, w in rewards], np.float64)
  mean = lambda values: float(np.mean(values))  # noqa: E731
  stats = [m.objective_stats for m in updates]
  tokens = float(made.lengths_B.sum())
  record = {"step": step, "reward_mean": float(total_B.mean()), "reward_std": float(total_B.std()),
            **{f"reward/{name}/mean": float(made.rewards_BxR[:, j].mean()) for j, (name, _, _) in enumerate(rewards)},
            **{f"reward/{name}/std": float(made.rewards_BxR[:, j].std()) for j, (name, _, _) in enumerate(rewards)},
            "advantage_std": float(np.std(made.advantages_B)), "loss": mean([m.loss for m in updates]),
            "kl": mean([s.kl for s in stats]), "clip_low": mean([s.clip_low for s in stats]),
            "clip_high": mean([s.clip_high for s in stats]), "grad_norm": mean([m.grad_norm for m in updates]),
            "learning_rate": float(updates[-1].learning_rate), "skipped": sum(int(m.skipped) for m in updates),
            "completion_length_mean": float(made.lengths_B.mean()), "completion_length_max": int(made.lengths_B.max()),
            "truncated": float(np.mean(~made.ended_B)),
            "sampling/sampling_logp_difference/mean": made.logp_difference[0],
            "sampling/sampling_logp_difference/max": made.logp_difference[1],
            "rollout_tokens_per_s": tokens / made.seconds,
            "train_tokens_per_s": len(updates) * tokens / train_s, "rollout_s": made.seconds, "train_s": train_s}
  if made.entropy is not None:
    record["entropy"] = made.entropy
  if run.data.objective.entropy_bonus:  # the policy's at the updates, over the bonus's tokens, as TRL's controller's
    record["entropy"], record["entropy_coef"] = mean([s.entropy for s in stats]), control.coef
  if run.model_cfg.dtype == "float16":
    record["loss_scale"] = float(updates[-1].loss_scale)
  if grpo.loss_type == "cispo":  # TRL's name for its one clip share
    record["cispo_clip_ratio"] = record.pop("clip_high")
    del record["clip_low"]
  if grpo.loss_type == "vespo":  # TRL's metric in place of the clip shares
    record["vespo/phi_seq_mean"] = mean([s.phi for s in stats])
    del record["clip_low"], record["clip_high"]
  return record


LEGEND = ("each line: reward = the mean ± std over the step's completions of the rewards' weighted sum;"
          " loss, kl (k3, to the starting policy; 0 without --beta) and clip (the share of completion tokens"
          " whose ratio was clipped) = means over the step's updates; length = the completions' mean tokens;"
          " rollout = sampling, scoring and log-probabilities, update = the optimizer steps, each with its"
          " completion tokens/s; skipped = updates not applied")


def _line(record: dict, steps: int) -> str:
  clipped = record.get("cispo_clip_ratio", record.get("clip_low", 0.0) + record.get("clip_high", 0.0))
  return (f"step {record['step']:5d}/{steps} | reward {record['reward_mean']:.4f} ± {record['reward_std']:.4f} |"
          f" loss {record['loss']:.4E} | kl {record['kl']:.3e} | clip {clipped:.3f} | length"
          f" {record['completion_length_mean']:.1f} | rollout {record['rollout_s']:.2f} s"
          f" ({record['rollout_tokens_per_s']:.0f} tokens/s) | update {record['train_s']:.2f} s"
          f" ({record['train_tokens_per_s']:.0f} tokens/s) | skipped {record['skipped']}")

