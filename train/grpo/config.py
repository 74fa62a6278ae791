"""``python -m train.grpo``'s configuration: GRPO's own flags (:class:`GRPOConfig`) and the
ones it shares with ``python -m train.gpt`` (:data:`SHARED`: fields of
:class:`train.run.config.Config`, with its names, help text, defaults and checks), one parser.

``--config FILE`` reads the flags from a YAML or JSON file, below the command line's
(``train/run/config_file.py``: one file holds the model's source, the prompts, rewards,
objective, optimizer, mesh and processes; ``docs/examples/grpo_gsm8k.yaml``), and
``--print-config`` prints them as one.

The run's :class:`~train.run.config.Config` (:func:`train_config`) is the starting run's (its
model) with the shared flags, the rollout's completions as its global batch and the
schedule counted in optimizer updates (``--lr-decay-steps`` by default ``--steps`` x
``--updates-per-rollout``). config.json keeps it under "train" and GRPO's flags under
"grpo"; ``--resume`` reads both back, and refuses a flag given anew with another value
unless it is one of :data:`MAY_CHANGE` (the others fix the rollouts and updates); the
multi-host flags are those of one invocation, never saved ones.

Nothing here imports jax: the entry point must know the mesh before JAX starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

from train.cli import Parser, UsageError
from train.run import config as config_lib
from train.run import config_file, flags
from train.run import restore as restore_lib
from train.store import rundir

# train.gpt's multi-host flags: they describe one invocation, never taken from a saved run.
MULTI_HOST = ("coordinator", "num_processes", "process_id", "distributed", "distributed_timeout", "heartbeat_timeout")
# Config fields train.grpo takes as train.gpt does.
SHARED = ("optimizer", "lr", "min_lr", "lr_warmup_steps", "lr_decay_style", "lr_decay_steps", "lr_wsd_decay_steps",
          "weight_decay", "scalar_weight_decay", "clip_grad", "grad_norm", "grad_norm_sketch_size", "skip_spikes", "max_skipped", "qk_clip_threshold",
          "initial_loss_scale", "loss_scale_window", "min_loss_scale", "dion_rank_fraction", "dion_momentum",
          "dion_qr_method", "dion_scale_rule", "dion_scalar_optimizer", "dion_replicate_sync",
          "dion_mixed_precision", "dion_split_q", "megabatch_mib", "ortho_dtype", "offload_optimizer", "dtype", "attention", "remat", "fp8", "loss_chunk",
          "sequence_parallel", "micro_batch_size", "mesh", "save_every", "keep", "step", "tensorboard", "wandb",
          *MULTI_HOST)
# Flags a resumed run may give anew with another value.
MAY_CHANGE = ("resume", "run_dir", "step", "steps", "save_every", "keep", "mesh", "micro_batch_size", "max_skipped",
              "remat", "offload_optimizer", "loss_chunk", "dion_split_q", "megabatch_mib", "tensorboard", "wandb",
              *MULTI_HOST)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """The loss's flags, TRL 1.16's ``GRPOConfig`` names and defaults but ``epsilon_high``'s
  (DAPO's 0.28; help: ``train.run.flags.GRPO_HELP``; the formulas:
  ``train/grpo/objective.py``, whose ``Objective`` adds what the rollout fixes)."""
  loss_type: str = "dapo"
  importance_sampling_level: str = "token"
  epsilon_low: float = 0.2
  epsilon_high: float = 0.28
  beta: float = 0.0
  use_bias_correction_kl: bool = True
  sapo_temperature_pos: float = 1.0
  sapo_temperature_neg: float = 1.05
  delta: float | None = None
  off_policy_mask_threshold: float | None = None
  vespo_k_pos: float = 2.0
  vespo_lambda_pos: float = 3.0
  vespo_k_neg: float = 3.0
  vespo_lambda_neg: float = 2.0
  entropy_coef: float = 0.0
  use_adaptive_entropy: bool = False
  entropy_coef_min: float = 0.0
  entropy_coef_max: float = 1.0
  entropy_coef_delta: float = 0.005
  entropy_target: float = 0.2

  @property
  def entropy_bonus(self) -> bool:
    """Whether the loss has the entropy term (TRL's ``_entropy_bonus_enabled``)."""
    return self.entropy_coef != 0 or self.use_adaptive_entropy

  def check(self) -> None:
    """Range checks (finite numbers: :meth:`GRPOConfig.check`); raises :class:`UsageError`."""
    for name in ("beta", "epsilon_low", "epsilon_high", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                 "vespo_lambda_neg", "entropy_coef", "entropy_coef_min", "entropy_coef_delta", "entropy_target"):
      if getattr(self, name) < 0:
        raise UsageError(f"{rundir.flag_name(name)} must be >= 0, got {getattr(self, name)}")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
      if getattr(self, name) <= 0:
        raise UsageError(f"{rundir.flag_name(name)} must be positive, got {getattr(self, name)}")
    if self.delta is not None and self.delta <= 1:
      raise UsageError(f"--delta must be > 1 (an upper bound on the ratio; INTELLECT-2 recommends above"
                       f" 1 + --epsilon-high), got {self.delta}")
    if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold <= 0:
      raise UsageError(f"--off-policy-mask-threshold must be positive (DeepSeek-V3.2's delta, e.g. 0.5), got"
                       f" {self.off_policy_mask_threshold}")
    if self.use_adaptive_entropy and self.entropy_coef_max < self.entropy_coef_min:
      raise UsageError(f"--entropy-coef-max {self.entropy_coef_max} is below --entropy-coef-min"
                       f" {self.entropy_coef_min}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(ObjectiveConfig):
  """GRPO's own flags and the loss's (help: ``train.run.flags.GRPO_HELP``); TRL's
  ``GRPOConfig`` names where it has them."""
  init_from: str | None = None
  prompts: str | None = None
  prompt_column: str = "prompt"
  answer_column: str = "answer"
  reward: tuple[str, ...] = ()
  run_dir: str | None = None
  steps: int = 100
  seed: int = 0
  resume: bool = False
  prompts_per_step: int = 8
  group_size: int = 8
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float = 1.0
  updates_per_rollout: int = 1
  pack: bool = True
  scale_rewards: str = "group"
  multi_objective_aggregation: str = "sum_then_normalize"
  top_entropy_quantile: float = 1.0

  @property
  def rollout_size(self) -> int:
    """Completions of a rollout: the global batch of its updates."""
    return self.prompts_per_step * self.group_size

  def check_inputs(self) -> None:
    """This process's own inputs exist: checked before it waits for the others
    (``--coordinator``), not for ``--print-config``, which may be written for another host."""
    if not self.init_from.startswith("hf:"):
      rundir.check_run(self.init_from, "--init-from", alternative=", or hf:DIR a Hugging Face checkpoint")
    if not os.path.exists(self.prompts):
      raise UsageError(f"--prompts {self.prompts} does not exist; pass a JSONL or Parquet file of prompts,"
                       " or a folder of Parquet files or a saved dataset")

  def check(self) -> None:
    """Range checks that need no devices; raises :class:`UsageError`."""
    missing = [rundir.flag_name(k) for k in ("init_from", "prompts", "reward", "run_dir") if not getattr(self, k)]
    if missing:
      raise UsageError(f"{', '.join(missing)} needed (or --resume --run-dir DIR a saved run)")
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{rundir.flag_name(field.name)} must be a finite number, got {value}")
    if self.group_size < 2:
      raise UsageError(f"--group-size must be >= 2 (advantages compare completions of one prompt),"
                       f" got {self.group_size}")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "updates_per_rollout"):
      if getattr(self, name) < 1:
        raise UsageError(f"{rundir.flag_name(name)} must be >= 1, got {getattr(self, name)}")
    restore_lib.check_sampling(self.temperature, self.top_k, self.top_p, greedy=False)
    if not 0 <= self.top_entropy_quantile <= 1:
      raise UsageError(f"--top-entropy-quantile must be in [0, 1] (1 keeps every token), got"
                       f" {self.top_entropy_quantile}")
    super().check()


_GRPO_FIELDS = tuple(f.name for f in dataclasses.fields(GRPOConfig))
_SHARED_FIELDS = [f for f in dataclasses.fields(config_lib.Config) if f.name in SHARED]


def parser() -> argparse.ArgumentParser:
  p = Parser(prog="python -m train.grpo", argument_default=argparse.SUPPRESS,
             description="GRPO fine-tuning of a python -m train.gpt run with verifiable rewards.")
  objective, fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}, dataclasses.fields(GRPOConfig)
  config_lib.add_flags(p.add_argument_group("GRPO"), [f for f in fields if f.name not in objective], flags.GRPO_HELP)
  config_lib.add_flags(p.add_argument_group("objective (TRL 1.16's GRPOConfig names)"),
                       [f for f in fields if f.name in objective], flags.GRPO_HELP)
  config_lib.add_flags(p.add_argument_group("optimizer, precision, mesh, checkpoints and processes (as"
                                            " train.gpt's)"), _SHARED_FIELDS, flags.HELP)
  p.add_argument("--config", metavar="FILE", help=flags.HELP["config"])
  p.add_argument("--print-config", action="store_true", help=flags.HELP["print_config"])
  return p


def parse(argv: list[str] | None) -> tuple[GRPOConfig, dict]:
  """GRPO's flags and the shared ones (:func:`command`)."""
  return command(argv)[:2]


def command(argv: list[str] | None) -> tuple[GRPOConfig, dict, bool]:
  """GRPO's flags and the shared ones given on the command line, in the ``--config`` file below
  it or, with ``--resume``, saved below both, as Config field values (paths made absolute);
  and whether ``--print-config`` was given."""
  p = parser()
  given = vars(p.parse_args(argv))
  print_config = given.pop("print_config", False)
  if "reward" in given:
    given["reward"] = tuple(given["reward"])
  if "config" in given:
    fields = [*dataclasses.fields(GRPOConfig), *_SHARED_FIELDS]
    given = {**config_file.given(given.pop("config"), p, fields, config_lib.PER_INVOCATION), **given}
  given.update({k: os.path.abspath(given[k]) for k in ("init_from", "prompts", "run_dir") if k in given})
  if given.get("resume"):
    if "run_dir" not in given:
      raise UsageError("--resume needs --run-dir, the run to continue")
    saved = saved_flags(given["run_dir"])
    given = rundir.resumed(saved, given, set(saved) - set(MAY_CHANGE),
                           "its rollouts and updates follow from it")
  grpo = GRPOConfig(**{k: v for k, v in given.items() if k in _GRPO_FIELDS})
  return grpo, {k: v for k, v in given.items() if k in SHARED}, print_config


def flags_record(grpo: GRPOConfig, shared: dict) -> dict:
  """Every flag's value, as ``--print-config`` writes them (a ``--config`` file of the same run):
  GRPO's and the shared ones, train.gpt's default where not given."""
  defaults = config_lib.Config()
  return {**dataclasses.asdict(grpo), **{k: shared.get(k, getattr(defaults, k)) for k in SHARED}}


def saved_flags(run_dir: str) -> dict:
  """The flags saved in ``run_dir``'s config.json: GRPO's and the shared ones."""
  record = rundir.saved_record(run_dir)
  if record is None or not isinstance(record.get("grpo"), dict):
    raise UsageError(f"--resume: {run_dir} holds no GRPO run (config.json with a \"grpo\" record);"
                     " start it without --resume")
  grpo = {k: tuple(v) if k == "reward" else v for k, v in record["grpo"].items() if k in _GRPO_FIELDS}
  shared = {k: v for k, v in record["train"].items() if k in SHARED and k not in config_lib.PER_INVOCATION}
  return {**grpo, **config_lib.current_values(shared)}


def train_config(grpo: GRPOConfig, shared: dict, start: dict) -> config_lib.Config:
  """The run's Config (module docstring): ``start`` the saved fields of the starting run
  (of this run once resumed); a new run takes none of its :data:`SHARED` flags (their
  defaults are train.gpt's, as ``--help`` says), only what describes its model."""
  if not grpo.resume:
    start = {k: v for k, v in start.items() if k not in SHARED}
  decay = shared.get("lr_decay_steps") or grpo.steps * grpo.updates_per_rollout
  cfg = config_lib.Config(**{**start, **shared, "steps": grpo.steps, "seed": grpo.seed, "run_dir": grpo.run_dir,
                             "ckpt_dir": None, "name": None, "resume": grpo.resume, "lr_decay_steps": decay,
                             "global_batch_size": grpo.rollout_size})
  cfg.check()
  return cfg
