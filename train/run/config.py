"""The trainer's one configuration: a frozen dataclass, its command line, its JSON.

Every flag of ``python -m train.gpt`` is a field of :class:`Config` with the same name
(``--lr-warmup-steps`` is ``lr_warmup_steps``); its default lives in the dataclass, its
help text in ``train/run/flags.py``. ``--config FILE`` reads flags from a YAML or JSON file
(``train/run/config_file.py``), below those of the command line. With ``--resume``, flags
left off the command line (and the file) keep the values saved in the run's
``config.json``, so ``--resume --run-dir DIR`` alone continues a run as it was started.

Nothing here imports jax: the entry point must know the mesh (how many host devices to
create) and the multi-host flags before JAX starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

from train.cli import Parser, UsageError
from train.run import config_file
from train.run.flags import ALIASES, BARE_VALUES, CHOICES, DEFAULT_LR, FORMER_VALUES, FP8_RECIPES, HELP, METAVARS
from train.store import hub, rundir, tracking

# The optimizer flags each --optimizer reads (train/run/optim.py); the others do nothing there.
_ORTHOGONAL_FLAGS = ("dion_scale_rule", "dion_scalar_optimizer", "ortho_dtype", "megabatch_mib")
OPTIMIZER_FLAGS = {
    "dion": ("dion_rank_fraction", "dion_momentum", "dion_qr_method", "dion_power_precision", "dion_qr_precision",
             "dion_scale_rule", "dion_scalar_optimizer", "dion_replicate_sync", "dion_split_q",
             "megabatch_mib", "grad_norm", "grad_norm_sketch_size"),
    **dict.fromkeys(("dion2", "nordion2", "normuon", "muon"), _ORTHOGONAL_FLAGS),
    "adamw": (), "lion": (),
}


def megabatch_bytes(mib: float) -> int | None:
  """``--megabatch-mib`` as the matrix optimizers' ``megabatch_bytes`` (0: None, off)."""
  return max(1, int(mib * 2**20)) if mib else None


@dataclasses.dataclass(frozen=True)
class Config:
  # model
  preset: str = "tiny"
  init_from: str | None = None
  qk_norm: str | None = None
  mlp: str | None = None
  num_layers: int | None = None
  hidden_size: int | None = None
  num_attention_heads: int | None = None
  seq_len: int | None = None
  dtype: str | None = None
  attention: str = "auto"
  remat: str = "none"
  fp8: str = "none"
  loss_chunk: int = 0
  sequence_parallel: bool = False
  virtual_stages: int = 1
  # mixture of experts (None: the preset's)
  num_experts: int | None = None
  moe_every: int | None = None
  moe_ffn_hidden_size: int | None = None
  moe_top_k: int | None = None
  moe_capacity_factor: float | None = None
  moe_shared_expert: bool = False
  moe_aux_loss_coeff: float | None = None
  moe_z_loss_coeff: float | None = None
  # data
  data: tuple[str, ...] = ("stdlib",)
  valid_data: str | None = None
  pack: bool = True
  document_mask: bool = False
  vocab_size: int | None = None
  # optimizer
  optimizer: str = "dion"
  lr: float | None = None
  min_lr: float = 0.0
  lr_warmup_steps: int | None = None
  lr_decay_style: str = "cosine"
  lr_decay_steps: int | None = None
  lr_wsd_decay_steps: int | None = None
  weight_decay: float = 0.01
  scalar_weight_decay: float = 0.0
  qk_clip_threshold: float | None = None
  clip_grad: float = 1.0
  skip_spikes: float = 0.0
  grad_norm: str = "sketch"
  grad_norm_sketch_size: int = 1024
  max_skipped: int = 10
  # float16 loss scaling
  initial_loss_scale: float = 2.0**16
  loss_scale_window: int = 1000
  min_loss_scale: float = 1.0
  dion_rank_fraction: float | None = None
  dion_momentum: float = 0.95
  dion_qr_method: str = "auto"
  dion_power_precision: str = "default"
  dion_qr_precision: str = "float32"
  dion_scale_rule: str = "fan_ratio"
  dion_scalar_optimizer: str = "adamw"
  dion_replicate_sync: bool = True
  dion_mixed_precision: bool = False
  dion_split_q: bool = False
  megabatch_mib: float = 0.0
  ortho_dtype: str = "bfloat16"
  offload_optimizer: bool = False
  # batch and steps
  global_batch_size: int = 16
  micro_batch_size: int | None = None
  steps: int = 200
  seed: int = 0
  # parallelism
  mesh: str | None = None
  # logging and evaluation
  log_interval: int = 10
  eval_every: int = 100
  eval_tokens: int = 16384
  tensorboard: str | None = None
  wandb: str | None = None
  profile_steps: str | None = None
  # run directory and checkpoints
  name: str | None = None
  run_dir: str | None = None
  ckpt_dir: str | None = None
  save_every: int = 100
  keep: int = 2
  resume: bool = False
  step: int | None = None
  # multi-host
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  distributed: bool = False
  distributed_timeout: int = 300
  heartbeat_timeout: int = 100

  @property
  def learning_rate(self) -> float:
    return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

  @property
  def decay_steps(self) -> int:
    return self.steps if self.lr_decay_steps is None else self.lr_decay_steps

  @property
  def warmup_steps(self) -> int:
    return self.decay_steps // 20 if self.lr_warmup_steps is None else self.lr_warmup_steps

  @property
  def megabatch_bytes(self) -> int | None:
    return megabatch_bytes(self.megabatch_mib)

  @property
  def run_path(self) -> str:
    start = hub.run_name(self.init_from[len("hf:"):]) if self.init_from else self.preset
    name = self.name or f"{start}-{self.optimizer}"
    return os.path.abspath(self.run_dir or os.path.join("runs", name))

  @property
  def ckpt_path(self) -> str:
    return os.path.abspath(self.ckpt_dir or os.path.join(self.run_path, "checkpoints"))

  @property
  def tensorboard_path(self) -> str | None:
    """The event files' directory of ``--tensorboard [DIR]`` (bare: RUN_DIR/tensorboard), or None."""
    if self.tensorboard is None:
      return None
    return os.path.abspath(self.tensorboard or os.path.join(self.run_path, "tensorboard"))

  @property
  def profile_range(self) -> tuple[int, int] | None:
    """``--profile-steps A:B`` as ``(A, B)``, or None; a malformed value is a UsageError."""
    if self.profile_steps is None:
      return None
    first, _, last = self.profile_steps.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
      raise UsageError(f"--profile-steps {self.profile_steps}: expected A:B, the first and last step to"
                       " trace, with 1 <= A <= B (e.g. 5:7)")
    return int(first), int(last)

  @property
  def data_spec(self) -> str:
    """``--data`` as a ``data.load_source`` spec (a Megatron-style blend ``W1 S1 W2 S2``
    becomes ``W1:S1,W2:S2``; ``fineweb:`` and ``megatron:`` prefixes are dropped, the
    loader tells the formats apart)."""
    parts = [strip_format(p) for p in self.data]
    if len(parts) == 1:
      return parts[0]
    if len(parts) % 2:
      raise UsageError(f"--data {' '.join(self.data)}: a blend is pairs of WEIGHT SOURCE,"
                       " e.g. --data 0.7 fineweb:'dir/*.bin' 0.3 stdlib")
    return ",".join(f"{w}:{s}" for w, s in zip(parts[::2], parts[1::2]))

  @property
  def valid_spec(self) -> str | None:
    if self.valid_data is not None:
      return strip_format(self.valid_data) or None
    return "stdlib:val" if self.data_spec in ("stdlib", "stdlib:train") else None

  def ignored_flags(self) -> list[str]:
    """The optimizer flags set away from their defaults that ``--optimizer`` does not read."""
    every = {name for names in OPTIMIZER_FLAGS.values() for name in names}
    defaults = Config()
    return [f"--{n.replace('_', '-')}" for n in sorted(every - set(OPTIMIZER_FLAGS[self.optimizer]))
            if getattr(self, n) != getattr(defaults, n)]

  def check(self) -> None:
    """Range checks that need no devices; raises :class:`UsageError`."""
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"--{field.name.replace('_', '-')} must be a finite number, got {value}")
    positive = ("virtual_stages", "global_batch_size", "steps", "step", "log_interval", "keep",
                "max_skipped", "micro_batch_size", "num_layers", "hidden_size",
                "num_attention_heads", "seq_len", "vocab_size", "num_processes",
                "loss_scale_window", "distributed_timeout", "heartbeat_timeout", "moe_top_k", "moe_every", "moe_ffn_hidden_size",
                "moe_capacity_factor")
    for name in positive:
      value = getattr(self, name)
      if value is not None and value < 1:
        raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("eval_every", "eval_tokens", "save_every", "lr_warmup_steps", "clip_grad", "skip_spikes",
                 "weight_decay", "scalar_weight_decay", "min_lr", "lr_decay_steps", "lr_wsd_decay_steps",
                 "num_experts", "moe_aux_loss_coeff", "moe_z_loss_coeff", "loss_chunk", "megabatch_mib"):
      if (getattr(self, name) or 0) < 0:
        raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
    if self.fp8 not in FP8_RECIPES:
      raise UsageError(f"--fp8 {self.fp8}: unknown recipe; choose one of {', '.join(FP8_RECIPES)}"
                       " (--fp8 alone: current)")
    for name in ("lr", "initial_loss_scale", "min_loss_scale", "qk_clip_threshold"):
      if getattr(self, name) is not None and getattr(self, name) <= 0:
        raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
    if self.min_lr > self.learning_rate:
      raise UsageError(f"--min-lr {self.min_lr:g} exceeds the peak --lr {self.learning_rate:g}; the decay"
                       f" ends at --min-lr, so choose it in [0, {self.learning_rate:g}]")
    size = self.grad_norm_sketch_size
    if size < 2 or size & (size - 1):
      raise UsageError(f"--grad-norm-sketch-size must be a power of two of at least 2, got {size}"
                       " (e.g. 1024: 4 kB per replica)")
    if not 0 <= self.dion_momentum < 1:
      raise UsageError(f"--dion-momentum must be in [0, 1), got {self.dion_momentum:g}")
    if self.dion_rank_fraction is not None and not 0 < self.dion_rank_fraction <= 1:
      raise UsageError(f"--dion-rank-fraction must be in (0, 1], got {self.dion_rank_fraction}")
    if self.min_loss_scale > self.initial_loss_scale:
      raise UsageError(f"--min-loss-scale {self.min_loss_scale:g} exceeds --initial-loss-scale"
                       f" {self.initial_loss_scale:g}")
    if self.warmup_steps > self.decay_steps:
      raise UsageError(f"--lr-warmup-steps {self.warmup_steps} exceeds the decay steps"
                       f" {self.decay_steps}; lower it or raise --lr-decay-steps")
    if self.coordinator is not None:
      host, _, port = self.coordinator.rpartition(":")
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator {self.coordinator}: expected HOST:PORT with a port in"
                         " 1..65535, e.g. 10.0.0.1:1234")
    if self.profile_range and self.profile_range[1] > self.steps:
      raise UsageError(f"--profile-steps {self.profile_steps} ends past --steps {self.steps}; choose steps"
                       f" up to {self.steps}")
    tracking.check(self.tensorboard, self.wandb)
    if self.step is not None and not self.resume:
      raise UsageError(f"--step {self.step} picks the checkpoint to resume from; add --resume")
    multi = (self.coordinator, self.num_processes, self.process_id)
    if any(v is not None for v in multi) and None in multi:
      raise UsageError("multi-host runs need all of --coordinator HOST:PORT, --num-processes"
                       " and --process-id (or --distributed to let JAX detect them)")
    if self.init_from is not None:
      if not self.init_from.startswith("hf:") or len(self.init_from) == 3:
        raise UsageError(f"--init-from {self.init_from}: expected hf:DIR, a Hugging Face"
                         " checkpoint directory (config.json + safetensors), or hf:ORG/NAME[@REVISION]")
      shape_flags = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden_size", "num_attention_heads",
                                                          "qk_norm", "mlp", "num_experts", "moe_top_k", "moe_every",
                                                          "moe_ffn_hidden_size")
                     if getattr(self, n) is not None]
      shape_flags += ["--moe-shared-expert"] if self.moe_shared_expert else []
      if shape_flags:
        raise UsageError(f"--init-from takes the model's shape from its config.json; drop"
                         f" {', '.join(shape_flags)}")
    self.data_spec  # noqa: B018  raises on a malformed blend

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def strip_format(spec: str) -> str:
  """A data spec without its ``fineweb:`` / ``megatron:`` prefix (the loader tells them apart)."""
  for prefix in ("fineweb:", "megatron:"):
    if spec.startswith(prefix):
      return spec[len(prefix):]
  return spec


def add_flags(parser: argparse.ArgumentParser, fields: list[dataclasses.Field], help: dict[str, str]) -> None:
  """One flag per dataclass field, named as it (``lr_warmup_steps``: ``--lr-warmup-steps``),
  typed by its annotation, its values from :data:`train.run.flags.CHOICES`, its help from
  ``help``, its other names from :data:`train.run.flags.ALIASES`; a bool field is a switch
  (``--no-X`` too when it defaults to on), a tuple field takes one or more values (repeated
  flags add up), a field of :data:`train.run.flags.BARE_VALUES` may leave its value off. Left off, a flag sets nothing (the
  parser's ``argument_default`` should be SUPPRESS), so a resumed run tells the flags given
  from the saved ones."""
  for field in fields:
    names = ("--" + field.name.replace("_", "-"), *ALIASES.get(field.name, ()))
    kind = field.type.split(" |")[0]
    if kind == "bool":
      action = argparse.BooleanOptionalAction if field.default else "store_true"
      parser.add_argument(*names, action=action, help=help[field.name])
    elif field.name in BARE_VALUES:
      parser.add_argument(*names, nargs="?", const=BARE_VALUES[field.name], metavar=METAVARS.get(field.name),
                          help=help[field.name])
    elif kind.startswith("tuple"):
      parser.add_argument(*names, nargs="+", action="extend", metavar=METAVARS.get(field.name), help=help[field.name])
    else:
      parser.add_argument(*names, type={"int": int, "float": float}.get(kind, str), metavar=METAVARS.get(field.name),
                          choices=CHOICES.get(field.name), help=help[field.name])


def _parser() -> argparse.ArgumentParser:
  parser = Parser(prog="python -m train.gpt", argument_default=argparse.SUPPRESS,
                  description="Train a GPT with Dion (or AdamW, Lion, Muon) on a device mesh.")
  add_flags(parser, dataclasses.fields(Config), HELP)
  parser.add_argument("--config", metavar="FILE", help=HELP["config"])
  parser.add_argument("--print-config", action="store_true", help=HELP["print_config"])
  return parser


def parse(argv: list[str] | None = None) -> Config:
  """The run's Config from the command line (and, with ``--resume``, its saved config)."""
  return command(argv)[0]


def command(argv: list[str] | None = None) -> tuple[Config, bool]:
  """The run's Config from the command line, the ``--config`` file below it and, with
  ``--resume``, the saved config below both; and whether ``--print-config`` was given."""
  parser = _parser()
  given = vars(parser.parse_args(argv))
  print_config = given.pop("print_config", False)
  if "data" in given:
    given["data"] = tuple(given["data"])
  if "config" in given:
    given = {**config_file.given(given.pop("config"), parser, dataclasses.fields(Config), PER_INVOCATION), **given}
  values = dict(given)
  if given.get("resume"):
    start = Config(**given)
    saved = saved_config(start.run_path, start.ckpt_path)
    values = {**rundir.resumed(saved, given, ("global_batch_size",),
                               "its data position and consumed tokens count steps of that size"),
              **_kept_schedule(saved, given)}
  return Config(**values), print_config


def _kept_schedule(saved: dict, given: dict) -> dict:
  """With ``--resume``, a new --steps keeps the decay length the run started with
  (``train.run.preflight.schedule_warning`` says so once the run starts; --lr-decay-steps
  stretches it)."""
  if ("steps" in given and "lr_decay_steps" not in given and saved.get("lr_decay_steps") is None
      and saved.get("steps", given["steps"]) != given["steps"]):
    return {"lr_decay_steps": saved["steps"]}
  return {}


# Flags that describe one invocation, not the run: never taken from a saved config.
PER_INVOCATION = ("resume", "step", "run_dir", "coordinator", "num_processes", "process_id", "distributed",
                   "distributed_timeout", "profile_steps", "heartbeat_timeout")


def saved_config(run_path: str, ckpt_path: str | None = None) -> dict:
  """The Config fields saved with the run in ``run_path`` (``train.store.rundir.saved_record``:
  its config.json, or its newest checkpoint's record), those of one invocation left out;
  empty when there is no run."""
  record = rundir.saved_record(run_path, ckpt_path)
  if record is None:
    return {}
  known = {f.name for f in dataclasses.fields(Config)}
  saved = {k: v for k, v in record["train"].items() if k in known and k not in PER_INVOCATION}
  if "data" in saved:
    saved["data"] = tuple(saved["data"])
  if "weight_decay" in saved:  # Runs saved before --scalar-weight-decay decayed all alike.
    saved.setdefault("scalar_weight_decay", saved["weight_decay"])
  saved.setdefault("grad_norm", "exact")  # Runs saved before --grad-norm took the mean's norm.
  return current_values(saved)


def current_values(saved: dict) -> dict:
  """``saved`` flags, the values runs wrote before a flag took words read as today's
  (:data:`train.run.flags.FORMER_VALUES`: ``remat: true`` is ``full``)."""
  return {k: FORMER_VALUES[k].get(v, v) if k in FORMER_VALUES and isinstance(v, bool) else v
          for k, v in saved.items()}
