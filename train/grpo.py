"""GRPO fine-tuning of a trained GPT with verifiable rewards:
``python -m train.grpo --init-from RUN_DIR --prompts FILE.jsonl --reward answer --reward format=0.2``.

Each step takes ``--prompts-per-step`` rows of the prompts file (in a seeded order, epoch
after epoch), writes ``--group-size`` G completions of each with ``models.generate``'s
key/value cache from the current policy (on-policy), scores them with the reward functions,
and takes ``--updates-per-rollout`` optimizer steps on the rollout
(``train/grpo_objective.py``: group-normalized advantages, the clipped ratio to the
rollout's policy, k3 KL to the frozen starting policy with ``--beta`` > 0, the
``--loss-type`` aggregation).

Prompts: one JSON object a line, ``"prompt"`` (text, tokenized as ``train.sample`` does)
or chat ``"messages"`` (rendered by the tokenizer's chat template with the generation
prompt), plus any columns the rewards read.

Rewards: ``NAME[=WEIGHT]`` (weight 1 by default), NAME a built-in or ``module:function``,
called as ``function(prompts=[...], completions=[...], **columns)`` with one list entry
per completion (TRL's convention) and returning one float per completion. Built in, for
answers written after the marker ``####`` (GSM8K's):

- ``answer``: 1 if the text after the completion's last ``####`` is the row's ``"answer"``
  column (stripped), else 0;
- ``format``: 1 if the completion ends with ``####`` and a non-empty answer, else 0.

The run directory holds ``config.json`` (the starting run's, so ``train.sample`` and
``train.export`` read the result as a run), ``metrics.jsonl`` (one record per step, its
fields listed in ``train/log.py``; also to ``--tensorboard [DIR]`` and ``--wandb PROJECT``)
and Orbax checkpoints of the policy. On ``--mesh`` (train.gpt's axes; one device by default) the policy is
sharded as in training and takes any optimizer of train.gpt; the rollout gathers it once
(``models.generate.rollout_params``). The log-probabilities and the loss take training's
forward (``models.token_logps``, ``models.loss`` with GRPO's per-token objective): on pp
pipelined in pp micro-batches, on cp split over the sequence (padded on the right to
2·cp chunks). ``--resume`` continues from the latest
checkpoint (policy, optimizer state, reference) with the flags saved in config.json (only
``--steps`` and ``--save-every`` may change) and the same rollouts as a run that never
stopped: the prompts' order and the sampler's seed follow from ``--seed`` and the step.
A run holds its directory's lock (``train.rundir``); a second run there is refused.

Bad input prints one ``error: ...`` line and exits with code 2: a missing run, prompts
file or reward module, an empty prompts file, G < 2, a prompt that leaves less than
``--max-new-tokens`` of the model's ``seq_len``, a reward that raises or is not finite, a
pp that does not divide a step's completions, a flag ``--resume`` may not change, a run
directory in use.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import models
from models import generate
from train import checkpoint as ckpt_lib
from train import cli, flags, grpo_objective, grpo_rewards, log, loop, optim, rundir, sample, tracking
from train import config as config_lib
from train import gpt as gpt_entry
from train.cli import UsageError

def read_prompts(path: str, tokenizer, limit: int) -> tuple[list[dict], list[np.ndarray]]:
  """The prompts file's rows and their tokens; each prompt at most ``limit`` tokens."""
  if not os.path.isfile(path):
    raise UsageError(f"--prompts {path} does not exist; pass a JSONL file of prompts")
  rows, tokens = [], []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise UsageError(f"--prompts {path}:{number}: not JSON ({e.msg})") from None
      if "messages" in row:
        if tokenizer.chat is None:
          raise UsageError(f"--prompts {path}:{number}: chat messages need a tokenizer with a chat"
                           " template (a run started from --init-from hf:DIR)")
        text = tokenizer.chat.render(row["messages"], add_generation_prompt=True)
        ids = tokenizer.encode(text, special=False)
        row = {**row, "prompt": text}
      elif isinstance(row.get("prompt"), str):
        ids = tokenizer.encode(row["prompt"])
      else:
        raise UsageError(f"--prompts {path}:{number}: a line needs a \"prompt\" string or chat \"messages\"")
      if not 1 <= len(ids) <= limit:
        raise UsageError(f"--prompts {path}:{number}: the prompt has {len(ids)} tokens; it must have"
                         f" 1 to {limit} (the model's seq_len less --max-new-tokens)")
      rows.append(row)
      tokens.append(np.asarray(ids, np.int32))
  if not rows:
    raise UsageError(f"--prompts {path} holds no prompts")
  return rows, tokens


def _parser() -> argparse.ArgumentParser:
  p = cli.Parser(prog="python -m train.grpo", description="GRPO fine-tuning of a train.gpt run.")
  p.add_argument("--init-from", metavar="RUN_DIR", help="the python -m train.gpt run to start from (needed)")
  p.add_argument("--prompts", help="JSONL file of prompts (\"prompt\" or \"messages\"; needed)")
  p.add_argument("--reward", action="append",
                 help="NAME[=WEIGHT]: a built-in (answer, format) or module:function; repeatable")
  p.add_argument("--run-dir", required=True, help="directory for config.json, metrics.jsonl and checkpoints")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--prompts-per-step", type=int, default=8)
  p.add_argument("--group-size", type=int, default=8, help="completions per prompt, G >= 2")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--updates-per-rollout", type=int, default=1)
  p.add_argument("--loss-type", choices=grpo_objective.AGGREGATIONS, default="dapo")
  p.add_argument("--epsilon-low", type=float, default=0.2)
  p.add_argument("--epsilon-high", type=float, default=0.28)
  p.add_argument("--beta", type=float, default=0.0, help="weight of the KL to the starting policy")
  p.add_argument("--no-scale-rewards", action="store_true", help="center advantages without dividing by the std")
  p.add_argument("--optimizer", choices=flags.OPTIMIZERS, default="adamw")
  p.add_argument("--mesh", default="fs=1", help="mesh axes as for train.gpt (default fs=1)")
  p.add_argument("--lr", type=float, default=1e-5)
  p.add_argument("--clip-grad", type=float, default=1.0)
  p.add_argument("--save-every", type=int, default=50)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tensorboard", nargs="?", const="", metavar="DIR", help=flags.HELP["tensorboard"])
  p.add_argument("--wandb", metavar="PROJECT", help=flags.HELP["wandb"])
  p.add_argument("--resume", action="store_true",
                 help="continue the run in --run-dir from its latest checkpoint with its saved flags"
                      " (only --steps and --save-every may change)")
  return p


# Flags a resumed run may change; the others fix its rollouts and updates, so they are the saved run's.
_RESUMABLE = ("resume", "run_dir", "steps", "save_every", "tensorboard", "wandb")
_PATHS = ("init_from", "prompts")


def parse(argv: list[str] | None) -> argparse.Namespace:
  """The flags of ``argv``. With ``--resume``, the flags saved in RUN_DIR/config.json fill
  in those not given, and a given flag other than :data:`_RESUMABLE` that differs from
  the saved one is refused (a UsageError naming it)."""
  parser = _parser()
  values = vars(parser.parse_args(argv))
  unset = object()  # not a string, so argparse passes it through no type
  parser.set_defaults(**{**dict.fromkeys(values, unset), "reward": None})  # an appending flag starts from None
  given = {k: v for k, v in vars(parser.parse_args(argv)).items()  # only the flags on the command line
           if v is not unset and v is not None}
  given.update({k: os.path.abspath(given[k]) for k in _PATHS if k in given})
  if given.get("resume"):
    saved = saved_flags(given["run_dir"])
    for key, value in given.items():
      if key not in _RESUMABLE and key in saved and saved[key] != value:
        flag = "--" + key.replace("_", "-")
        raise UsageError(f"--resume {flag} {value}: the run in {given['run_dir']} was saved with {flag}"
                         f" {saved[key]}; drop the flag (the saved one is used) or start a new --run-dir")
    values.update({k: v for k, v in saved.items() if k not in ("resume", "run_dir")})
  values.update(given)
  missing = [k for k in ("init_from", "prompts", "reward") if values[k] is None]
  if missing:
    raise UsageError(f"{', '.join('--' + k.replace('_', '-') for k in missing)} needed (or --resume a run)")
  return argparse.Namespace(**values)


def saved_flags(run_dir: str) -> dict:
  """The GRPO flags saved in ``run_dir/config.json`` (the ``"grpo"`` record)."""
  try:
    with open(os.path.join(run_dir, "config.json")) as f:
      return json.load(f)["grpo"]
  except (OSError, ValueError, KeyError, TypeError):
    raise UsageError(f"--resume: {run_dir} holds no readable GRPO run (config.json with a \"grpo\" record);"
                     " start it without --resume") from None


def _check(args: argparse.Namespace) -> None:
  if args.group_size < 2:
    raise UsageError(f"--group-size must be >= 2 (advantages compare completions of one prompt), got {args.group_size}")
  for name in ("steps", "prompts_per_step", "max_new_tokens", "updates_per_rollout", "save_every"):
    if getattr(args, name) < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if not (math.isfinite(args.temperature) and args.temperature > 0):
    raise UsageError(f"--temperature must be a finite number > 0 (GRPO samples), got {args.temperature}")
  if not 0 < args.top_p <= 1:
    raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
  if args.top_k is not None and args.top_k < 1:
    raise UsageError(f"--top-k must be positive, got {args.top_k}")
  if not (args.beta >= 0 and args.epsilon_low >= 0 and args.epsilon_high >= 0 and args.lr > 0):
    raise UsageError("--beta, --epsilon-low and --epsilon-high must be >= 0 and --lr > 0")
  saved = ckpt_lib.existing_steps(os.path.join(os.path.abspath(args.run_dir), "checkpoints"))
  if args.resume and not saved:
    raise UsageError(f"--resume: {args.run_dir} holds no GRPO checkpoint; start it without --resume")
  if args.resume and max(saved) >= args.steps:
    raise UsageError(f"--resume: the checkpoint is at step {max(saved)}, which already reaches --steps"
                     f" {args.steps}; pass a larger --steps")
  if not args.resume and os.path.exists(os.path.join(args.run_dir, "config.json")):
    raise UsageError(f"--run-dir {args.run_dir} already holds a run; choose a new directory or pass --resume")
  tracking.check(args.tensorboard, args.wandb)
  rundir.check_usable(os.path.abspath(args.run_dir), "--run-dir")
  rundir.Lock(os.path.abspath(args.run_dir)).check()


def _make_update(graphdef: Any, tx: optax.GradientTransformation, objective: grpo_objective.Objective,
                 temperature: float, clip_grad: float, par: models.Parallelism) -> Callable:
  terms = functools.partial(grpo_objective.weighted, objective)

  def loss_fn(params, batch):  # batch: grpo_objective.update_batch's
    loss, aux = models.loss(graphdef, params, batch, par, denominator=jnp.float32(1), aux=True,
                            objective=terms, temperature=temperature)
    return loss, aux.stats

  @jax.jit
  def update(params, opt_state, batch):
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    grad_norm = optax.tree.norm(grads)
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip_grad / (grad_norm + 1e-6)), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, stats, grad_norm

  return update


def _setup(argv: list[str] | None) -> tuple:
  """Flags, the starting model, tokenizer, rewards and prompts; bad input raises here."""
  args = parse(argv)
  _check(args)
  gpt_entry.start_jax(config_lib.Config(mesh=args.mesh))  # host devices for the mesh, before JAX starts
  mesh = loop.make_mesh(args.mesh)
  pp = dict(mesh.shape)["pp"]
  if (args.prompts_per_step * args.group_size) % pp:
    raise UsageError(f"--mesh {args.mesh}: the pipeline splits the {args.prompts_per_step * args.group_size}"
                     f" completions of a step (--prompts-per-step x --group-size) into pp={pp} micro-batches;"
                     " choose sizes whose product pp divides")
  par = models.Parallelism(mesh, microbatches=pp)
  with jax.set_mesh(mesh):
    restored = sample.restore(os.path.abspath(args.init_from), par=par)
  tokenizer = sample.run_tokenizer(os.path.abspath(args.init_from))
  rewards = grpo_rewards.reward_functions(args.reward)
  M = args.max_new_tokens
  limit = restored.cfg.seq_len - M
  if limit < 1:
    raise UsageError(f"--max-new-tokens {M} leaves no room for a prompt in seq_len {restored.cfg.seq_len}")
  rows, prompt_tokens = read_prompts(args.prompts, tokenizer, limit)
  saved = config_lib.saved_config(os.path.abspath(args.init_from))
  train_cfg = config_lib.Config(**{**saved, "optimizer": args.optimizer, "lr": args.lr, "lr_warmup_steps": 0,
                                   "lr_decay_style": "constant", "steps": args.steps,
                                   "run_dir": os.path.abspath(args.run_dir), "ckpt_dir": None, "resume": False,
                                   "tensorboard": args.tensorboard, "wandb": args.wandb, "profile_steps": None})
  return args, par, restored, tokenizer, rewards, rows, prompt_tokens, train_cfg


def train(setup: tuple) -> int:
  """The GRPO steps (module docstring); a reward's bad output prints ``error: ...``, exit 2."""
  try:
    return _steps(*setup)
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return cli.EXIT_USAGE


def _state(params: Any, opt_state: Any, reference: Any | None) -> dict:
  """What a checkpoint holds: the policy, its optimizer state, the reference (with KL).
  The prompts' order and the sampler's seeds follow from --seed and the step."""
  return {"params": params, "opt_state": opt_state, **({"reference": reference} if reference is not None else {})}


def _restore(checkpoints: ckpt_lib.Checkpoints, step: int, like: dict, par: models.Parallelism) -> dict:
  """Checkpoint ``step``'s state laid out like the live ``like`` (``train.checkpoint``)."""
  shapes = checkpoints.manager.item_metadata(step)["state"]
  saved = checkpoints.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(ckpt_lib.saved_structs(shapes, like))))
  return ckpt_lib.from_saved(saved["state"], like, par.pp, par.virtual_stages)


def _write_record(run_dir: str, record: dict) -> None:
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(record, f, indent=2)


def _steps(args, par, restored, tokenizer, rewards, rows, prompt_tokens, train_cfg) -> int:
  """The steps, holding the run directory's lock (``train.rundir``); a directory this call
  made stays only if a step was written into it."""
  created = not os.path.exists(train_cfg.run_path)
  lock = rundir.Lock(train_cfg.run_path)
  lock.acquire()
  try:
    with jax.set_mesh(par.mesh):
      return _steps_on_mesh(args, par, restored, tokenizer, rewards, rows, prompt_tokens, train_cfg)
  finally:
    rundir.remove_partial_saves(train_cfg.ckpt_path)
    lock.release()
    if created and not os.listdir(train_cfg.run_path):
      os.rmdir(train_cfg.run_path)


def _trackers(train_cfg: config_lib.Config, record: dict) -> list:
  return tracking.start(train_cfg.run_path, record, train_cfg.tensorboard_path, train_cfg.wandb)


def _steps_on_mesh(args, par, restored, tokenizer, rewards, rows, prompt_tokens, train_cfg) -> int:
  M, G = args.max_new_tokens, args.group_size
  graphdef, params = restored.graphdef, restored.params
  tx = optim.optimizer(train_cfg, params, par.mesh, models.param_specs(params))
  opt_state = tx.init(params)
  objective = grpo_objective.Objective(args.epsilon_low, args.epsilon_high, args.beta, args.loss_type, M)
  update = _make_update(graphdef, tx, objective, args.temperature, args.clip_grad, par)
  logps = jax.jit(functools.partial(grpo_objective.token_logps, par=par), static_argnums=(0, 4, 5))
  make_batch = jax.jit(functools.partial(grpo_objective.update_batch, objective=objective, cp=par.cp))
  reference = params if args.beta > 0 else None
  sampling = generate.Sampling(args.temperature, args.top_k, args.top_p)
  weights_R = jnp.asarray([w for _, _, w in rewards], jnp.float32)

  with open(os.path.join(os.path.abspath(args.init_from), "config.json")) as f:
    hf_config = json.load(f).get("hf_config")  # what train.export writes back
  record = {"train": train_cfg.to_json(), "model": dataclasses.asdict(restored.cfg), "grpo": vars(args),
            **({"hf_config": hf_config} if hf_config else {})}
  order = np.random.default_rng(args.seed).permutation(len(rows))
  metrics = checkpoints = None  # the run directory is written once a first step has passed
  start = 0
  if args.resume:
    checkpoints = ckpt_lib.Checkpoints(train_cfg.ckpt_path, keep=2, create=False)
    start = checkpoints.latest_step()
    state = _restore(checkpoints, start, _state(params, opt_state, reference), par)
    params, opt_state, reference = state["params"], state["opt_state"], state.get("reference")
    _write_record(args.run_dir, record)  # the new --steps / --save-every for the next --resume
    metrics = log.MetricsFile(args.run_dir, _trackers(train_cfg, record))
  try:
    for step in range(start + 1, args.steps + 1):
      picks = [order[((step - 1) * args.prompts_per_step + j) % len(rows)] for j in range(args.prompts_per_step)]
      t0 = time.perf_counter()
      out = generate.complete(graphdef, generate.rollout_params(params, par), [prompt_tokens[i] for i in picks], M,
                              sampling,
                              seed=args.seed * 1_000_003 + step, eos_id=tokenizer.eod, group_size=G)
      completions_BxM, lengths_B = np.asarray(out.tokens_BxM), np.asarray(out.lengths_B)
      rollout_s = time.perf_counter() - t0
      ended_B = np.asarray([length > 0 and row[length - 1] == tokenizer.eod
                            for row, length in zip(completions_BxM, lengths_B)])
      texts = [tokenizer.decode(row[:length - int(end)]) for row, length, end in zip(completions_BxM, lengths_B, ended_B)]
      prompts_text = [rows[i].get("prompt", "") for i in picks for _ in range(G)]
      rewards_BxR = grpo_rewards.score(rewards, [rows[i] for i in picks], prompts_text, texts, G)
      advantages_B = grpo_objective.advantages(jnp.asarray(rewards_BxR, jnp.float32), weights_R, G,
                                               not args.no_scale_rewards)
      prompts_BxP, prompt_lengths = generate.left_pad([prompt_tokens[i] for i in picks],
                                                      generate.bucket(max(len(prompt_tokens[i]) for i in picks)))
      prompts_BxP, prompt_lengths = np.repeat(prompts_BxP, G, 0), np.repeat(prompt_lengths, G)
      tokens_BxT = np.concatenate([prompts_BxP, completions_BxM], 1)
      pad_B = jnp.asarray(prompts_BxP.shape[1] - prompt_lengths)
      mask_BxM = (np.arange(M)[None] < lengths_B[:, None]).astype(np.float32)
      old_BxM = logps(graphdef, params, tokens_BxT, pad_B, M, args.temperature)
      ref_BxM = None if reference is None else logps(graphdef, reference, tokens_BxT, pad_B, M, args.temperature)
      batch = make_batch(tokens_BxT, pad_B, old_BxM, ref_BxM, advantages_B, jnp.asarray(mask_BxM),
                         num_items=jnp.float32(mask_BxM.sum()))
      t1 = time.perf_counter()
      for _ in range(args.updates_per_rollout):
        params, opt_state, loss, stats, grad_norm = update(params, opt_state, batch)
      jax.block_until_ready(params)
      train_s = time.perf_counter() - t1
      total_B = rewards_BxR @ np.asarray(weights_R, np.float64)
      entry = {"step": step, "reward_mean": float(total_B.mean()), "reward_std": float(total_B.std()),
               **{f"reward/{name}/mean": float(rewards_BxR[:, j].mean()) for j, (name, _, _) in enumerate(rewards)},
               **{f"reward/{name}/std": float(rewards_BxR[:, j].std()) for j, (name, _, _) in enumerate(rewards)},
               "advantage_std": float(jnp.std(advantages_B)), "loss": float(loss), "kl": float(stats.kl),
               "clip_low": float(stats.clip_low), "clip_high": float(stats.clip_high),
               "grad_norm": float(grad_norm), "completion_length_mean": float(lengths_B.mean()),
               "completion_length_max": int(lengths_B.max()), "truncated": float(np.mean(~ended_B)),
               "rollout_tokens_per_s": float(lengths_B.sum() / rollout_s),
               "train_tokens_per_s": float(args.updates_per_rollout * mask_BxM.sum() / train_s),
               "rollout_s": rollout_s, "train_s": train_s}
      if metrics is None:
        trackers = _trackers(train_cfg, record)  # first: one that cannot start leaves no run behind
        _write_record(args.run_dir, record)
        metrics = log.MetricsFile(args.run_dir, trackers, mode="w")
        checkpoints = ckpt_lib.Checkpoints(train_cfg.ckpt_path, keep=2, create=True)
      metrics.write(entry)
      print(f"step {step:5d}/{args.steps} | reward {entry['reward_mean']:.4f} ± {entry['reward_std']:.4f} |"
            f" kl {entry['kl']:.3e} | clip {entry['clip_low'] + entry['clip_high']:.3f} | length"
            f" {entry['completion_length_mean']:.1f} | rollout {rollout_s:.2f}s, train {train_s:.2f}s", flush=True)
      if step % args.save_every == 0 or step == args.steps:
        saved = ckpt_lib.to_saved(_state(params, opt_state, reference), par.pp, par.virtual_stages)
        checkpoints.save(step, saved, {"step": step}, record)
  finally:
    if metrics is not None:
      metrics.close()
      checkpoints.close()
  return 0


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: _setup(argv), train)


if __name__ == "__main__":
  sys.exit(main())
