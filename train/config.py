"""The trainer's one configuration: a frozen dataclass, its command line, its JSON.

Every flag of ``python -m train.gpt`` is a field of :class:`Config` with the same name
(``--lr-warmup-steps`` is ``lr_warmup_steps``); its default lives in the dataclass, its
help text in :data:`HELP`. With ``--resume``, flags left off the command line keep the
values saved in the run's ``config.json``, so ``--resume --run-dir DIR`` alone continues
a run as it was started.

Nothing here imports jax: the entry point must know the mesh (how many host devices to
create) and the multi-host flags before JAX starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

from train.cli import Parser, UsageError

PRESET_NAMES = ("tiny", "tiny-moe", "small", "350m", "1b")
OPTIMIZERS = ("dion", "dion2", "nordion2", "normuon", "muon", "adamw", "lion")
# Base learning rates; --lr overrides. The orthogonal family's is the reference's own
# (microsoft/dion's 160m configs); on tiny, 200 steps, the best of a 2x grid was 0.04
# for all four (benchmarks/results/optimizer_comparison.md).
DEFAULT_LR = {"dion": 0.02, "dion2": 0.02, "nordion2": 0.02, "normuon": 0.02, "muon": 0.02, "adamw": 3e-3, "lion": 3e-4}
DECAY_STYLES = ("constant", "linear", "cosine", "wsd")
# The optimizer flags each --optimizer reads (train/optim.py); the others do nothing there.
_ORTHOGONAL_FLAGS = ("dion_scale_rule", "dion_scalar_optimizer", "ortho_dtype")
OPTIMIZER_FLAGS = {
    "dion": ("dion_rank_fraction", "dion_momentum", "dion_qr_method", "dion_scale_rule",
             "dion_scalar_optimizer", "dion_replicate_sync"),
    **dict.fromkeys(("dion2", "nordion2", "normuon", "muon"), _ORTHOGONAL_FLAGS),
    "adamw": (), "lion": (),
}


@dataclasses.dataclass(frozen=True)
class Config:
  # model
  preset: str = "tiny"
  init_from: str | None = None
  qk_norm: str | None = None
  num_layers: int | None = None
  hidden_size: int | None = None
  num_attention_heads: int | None = None
  seq_len: int | None = None
  dtype: str | None = None
  attention: str = "auto"
  remat: bool = False
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
  max_skipped: int = 10
  # float16 loss scaling
  initial_loss_scale: float = 2.0**16
  loss_scale_window: int = 1000
  min_loss_scale: float = 1.0
  dion_rank_fraction: float = 1.0
  dion_momentum: float = 0.95
  dion_qr_method: str = "auto"
  dion_scale_rule: str = "fan_ratio"
  dion_scalar_optimizer: str = "adamw"
  dion_replicate_sync: bool = True
  dion_mixed_precision: bool = False
  ortho_dtype: str = "bfloat16"
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
  def run_path(self) -> str:
    start = os.path.basename(os.path.normpath(self.hf_dir)) if self.hf_dir else self.preset
    name = self.name or f"{start}-{self.optimizer}"
    return os.path.abspath(self.run_dir or os.path.join("runs", name))

  @property
  def ckpt_path(self) -> str:
    return os.path.abspath(self.ckpt_dir or os.path.join(self.run_path, "checkpoints"))

  @property
  def hf_dir(self) -> str | None:
    """The Hugging Face checkpoint directory of ``--init-from hf:DIR`` (absolute), or None."""
    return None if self.init_from is None else os.path.abspath(self.init_from[len("hf:"):])

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
                "loss_scale_window", "distributed_timeout", "moe_top_k", "moe_every", "moe_ffn_hidden_size",
                "moe_capacity_factor")
    for name in positive:
      value = getattr(self, name)
      if value is not None and value < 1:
        raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("eval_every", "eval_tokens", "save_every", "lr_warmup_steps", "clip_grad",
                 "weight_decay", "scalar_weight_decay", "min_lr", "lr_decay_steps", "lr_wsd_decay_steps",
                 "num_experts", "moe_aux_loss_coeff", "moe_z_loss_coeff"):
      if (getattr(self, name) or 0) < 0:
        raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
    if self.min_lr > self.learning_rate:
      raise UsageError(f"--min-lr {self.min_lr:g} exceeds the peak --lr {self.learning_rate:g}; the decay"
                       f" ends at --min-lr, so choose it in [0, {self.learning_rate:g}]")
    if not 0 <= self.dion_momentum < 1:
      raise UsageError(f"--dion-momentum must be in [0, 1), got {self.dion_momentum:g}")
    if not 0 < self.dion_rank_fraction <= 1:
      raise UsageError(f"--dion-rank-fraction must be in (0, 1], got {self.dion_rank_fraction}")
    for name in ("lr", "initial_loss_scale", "min_loss_scale", "qk_clip_threshold"):
      if getattr(self, name) is not None and getattr(self, name) <= 0:
        raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
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
    if self.step is not None and not self.resume:
      raise UsageError(f"--step {self.step} picks the checkpoint to resume from; add --resume")
    multi = (self.coordinator, self.num_processes, self.process_id)
    if any(v is not None for v in multi) and None in multi:
      raise UsageError("multi-host runs need all of --coordinator HOST:PORT, --num-processes"
                       " and --process-id (or --distributed to let JAX detect them)")
    if self.init_from is not None:
      if not self.init_from.startswith("hf:") or len(self.init_from) == 3:
        raise UsageError(f"--init-from {self.init_from}: expected hf:DIR, a Hugging Face"
                         " checkpoint directory (config.json + safetensors)")
      shape_flags = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden_size", "num_attention_heads",
                                                          "qk_norm", "num_experts", "moe_top_k", "moe_every",
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


HELP = {
    "preset": "model size: %s (default tiny: 4 layers x 128, seq 128)" % "|".join(PRESET_NAMES),
    "qk_norm": "none|rms|rms_scale: QK-norm of the preset's attention (default rms, the reference's;"
               " none as Llama, rms_scale as Qwen3)",
    "init_from": "hf:DIR: start from a Hugging Face Llama, Qwen3 or Qwen3-MoE checkpoint in the local"
                 " folder DIR (config.json + safetensors; not a Hub id: huggingface-cli download"
                 " ORG/NAME --local-dir DIR first) instead of a random preset; --seq-len sets the"
                 " training length (default min(max_position_embeddings, 1024)); the run is"
                 " runs/BASENAME(DIR)-OPTIMIZER unless --name/--run-dir",
    "num_layers": "override the preset's number of transformer layers",
    "hidden_size": "override the preset's model width d_model",
    "num_attention_heads": "override the preset's attention heads (must divide the hidden size)",
    "seq_len": "override the preset's tokens per sequence",
    "dtype": "compute dtype float32|bfloat16|float16 (default: bfloat16 on GPU, float32 on"
             " CPU); parameters and optimizer state stay float32; float16 scales the loss"
             " dynamically (Megatron's --fp16)",
    "attention": "auto|xla|cudnn: implementation of attention (default auto: cuDNN's fused"
                 " attention on an NVIDIA GPU in bfloat16 or float16, XLA's otherwise)",
    "remat": "recompute each layer's activations in the backward pass (less memory)",
    "sequence_parallel": "shard activations along the sequence over tp between layers",
    "virtual_stages": "stages per pp device of a circular (interleaved) pipeline (default 1)",
    "num_experts": "mixture of experts: the MLP of every layer (every --moe-every-th) becomes"
                   " this many experts of the preset's MLP width, split over the mesh's ep axis"
                   " (default: the preset's; tiny-moe has 8; 0 for a dense MLP)",
    "moe_ffn_hidden_size": "hidden width of each expert (default: the preset's MLP width; the"
                           " dense layers of --moe-every keep it)",
    "moe_every": "experts on every n-th layer only (layers n-1, 2n-1, ...; Qwen3-MoE's"
                 " decoder_sparse_step), dense MLPs between; n divides the layers (default 1:"
                 " every layer)",
    "moe_top_k": "experts per token (default 2)",
    "moe_capacity_factor": "cap each expert at ceil(c x seq_len x top_k / experts) tokens per"
                           " sequence and drop the overflow, counted in the log (default:"
                           " dropless, every token routed)",
    "moe_shared_expert": "add a dense shared expert of the MLP width that every token goes through",
    "moe_aux_loss_coeff": "weight of each MoE layer's load-balancing loss (default 0.01)",
    "moe_z_loss_coeff": "weight of each MoE layer's router z-loss (default 0.001)",
    "data": "training data: stdlib (the embedded corpus, default) | fineweb:GLOB |"
            " megatron:PREFIX | sft:FILE.jsonl (lines {\"prompt\", \"completion\"}, loss on the"
            " completion, or {\"messages\": [...]}, rendered by --init-from's chat template,"
            " loss on the assistant turns; tokenized with --init-from's tokenizer, else bytes) | a blend W1 SRC1 W2 SRC2 ... (e.g. 0.7 fineweb:'d/*.bin' 0.3 stdlib)",
    "valid_data": "validation data spec (default: stdlib:val for the embedded corpus, none otherwise)",
    "pack": "sft: data: pack several examples per sequence, attention kept within each"
            " (default on; --no-pack: one example per sequence)",
    "document_mask": "pretraining data: attention within each document of a window and"
                     " positions restarting at each end-of-document token (Megatron's"
                     " --reset-attention-mask --reset-position-ids; default off)",
    "vocab_size": "tokenizer vocabulary size, where the data does not record it (Megatron datasets)",
    "optimizer": "%s (default dion: Dion on matrices, --dion-scalar-optimizer on the rest;"
                 " dion2 (fraction 1/4), nordion2 (fraction 1/4), normuon and muon: dion_jax's,"
                 " sharded like Dion, with"
                 " the same scalar optimizer on the rest; adamw, lion: optax's on everything)"
                 % "|".join(OPTIMIZERS),
    "lr": "peak learning rate (default: %s)" % ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()),
    "min_lr": "learning rate at the end of the decay (default 0)",
    "lr_warmup_steps": "linear warmup to --lr over this many steps (default: 5%% of the decay steps)",
    "lr_decay_style": "%s after warmup (default cosine; wsd: constant, then linear decay over"
                      " --lr-wsd-decay-steps)" % "|".join(DECAY_STYLES),
    "lr_decay_steps": "steps over which warmup and decay run (default --steps); set it when a"
                      " run is split over several invocations",
    "lr_wsd_decay_steps": "final decay steps of wsd (default: a fifth of the decay steps)",
    "weight_decay": "decoupled weight decay of the matrices, times the learning rate (default 0.01)",
    "qk_clip_threshold": "QK-clip (MuonClip): after each step, shrink the query and key kernels of every"
                         " attention head whose largest logit exceeded this, to it (default off;"
                         " needs --qk-norm none or a Llama checkpoint); the log shows the largest"
                         " logit and the clipped heads",
    "scalar_weight_decay": "weight decay of everything else: embeddings, LM head, norms (default 0,"
                           " microsoft/dion's recipe; runs saved before this flag resume with"
                           " --weight-decay's value)",
    "clip_grad": "clip the gradient to this global norm, 0 for none (default 1.0); with Dion's"
                 " per-replica gradients the norm of their mean",
    "max_skipped": "stop after this many consecutive skipped steps (default 10): steps whose"
                   " loss, gradient, new parameters or optimizer state would not be finite,"
                   " float16 overflows included; skipped steps change nothing",
    "initial_loss_scale": "--dtype float16: the loss scale a run starts from (default 65536 ="
                          " 2^16, as torch.amp's; each halving is a skipped step: from Megatron's"
                          " 2^32, tiny skips 16, past the default --max-skipped); a resumed run"
                          " continues from its saved scale",
    "loss_scale_window": "--dtype float16: double the loss scale after this many finite steps"
                         " in a row (default 1000, as Megatron's)",
    "min_loss_scale": "--dtype float16: never halve the loss scale below this (default 1, as"
                      " Megatron's)",
    "dion_rank_fraction": "Dion's rank r / min(m, n), in (0, 1] (default 1; 0.25 cuts"
                          " its compute and data-parallel traffic)",
    "dion_momentum": "Dion's error-feedback momentum mu (default 0.95)",
    "dion_qr_method": "auto|shifted_cqr|cqr|rcqr|qr orthonormalization of Dion's power iteration"
                      " (default auto: shifted_cqr, batched Cholesky QR with no loop over"
                      " matrices, on a GPU; rcqr on a CPU)",
    "dion_scale_rule": "fan_ratio|spectral|max_one|none shape scale of Dion's update"
                       " (default fan_ratio, the reference's sqrt(fan_out/fan_in))",
    "dion_scalar_optimizer": "adamw|lion for embeddings, LM head and norms (default adamw)",
    "ortho_dtype": "bfloat16|float32: dtype of dion2/normuon/muon's orthogonalization (default"
                   " bfloat16, as the reference; float32 replays exactly on every mesh)",
    "dion_mixed_precision": "keep Dion's momentum and Q in bfloat16 (microsoft/dion's"
                            " mixed_precision: true; default off: the parameter's dtype)",
    "dion_replicate_sync": "with rp > 1 keep per-replica momentum and average only Dion's"
                           " low-rank factors over rp (default on)",
    "global_batch_size": "sequences per optimizer step over all devices (default 16)",
    "micro_batch_size": "sequences per data-parallel rank per micro-step (default: all of"
                        " them); micro-batches = global / (micro x rp x fs) feed gradient"
                        " accumulation, or the pipeline when pp > 1",
    "steps": "optimizer steps of the run, counted from its start (default 200)",
    "seed": "seed of the initialization, Dion's sketches and the data order (default 0)",
    "mesh": "device mesh, e.g. rp=1,fs=2,tp=2, over the axes rp (replicas: data parallel, Dion's"
            " momentum per replica), fs (fully sharded data parallel), ep (experts), cp (context:"
            " the sequence split), tp (tensor parallel), pp (pipeline stages); missing ones are 1;"
            " default fs=<all devices>; on CPU the trainer creates the host devices it needs",
    "log_interval": "steps between log lines (default 10)",
    "eval_every": "steps between validation evaluations, 0 for only at the end (default 100)",
    "eval_tokens": "validation tokens per evaluation (default 16384)",
    "name": "run name: the run directory is runs/NAME (default PRESET-OPTIMIZER, or"
            " BASENAME(DIR)-OPTIMIZER with --init-from hf:DIR)",
    "run_dir": "run directory for config.json, metrics.jsonl and checkpoints (default runs/NAME)",
    "ckpt_dir": "checkpoint directory (default RUN_DIR/checkpoints)",
    "save_every": "steps between checkpoints, 0 for only at the end (default 100)",
    "keep": "checkpoints to keep, newest first (default 2)",
    "resume": "continue from the latest complete checkpoint; flags left off keep the values"
              " saved in the run's config.json (or, without it, in the checkpoint); a new --steps"
              " keeps the saved lr schedule unless --lr-decay-steps is given",
    "step": "with --resume: continue from this checkpoint step instead of the latest (to go"
            " back past a damaged or unwanted one); the newer checkpoints are deleted",
    "coordinator": "multi-host: HOST:PORT of process 0's coordinator",
    "num_processes": "multi-host: number of processes",
    "process_id": "multi-host: this process's index in [0, --num-processes)",
    "distributed": "multi-host with jax.distributed.initialize's auto-detection (SLURM, Open MPI, TPU)",
    "distributed_timeout": "multi-host: seconds to wait for every process to join the coordinator"
                           " (default 300)",
}


def _parser() -> argparse.ArgumentParser:
  parser = Parser(prog="python -m train.gpt", argument_default=argparse.SUPPRESS,
                  description="Train a GPT with Dion (or AdamW, Lion, Muon) on a device mesh.")
  choices = {"preset": PRESET_NAMES, "dtype": ("float32", "bfloat16", "float16"),
             "attention": ("auto", "xla", "cudnn"), "optimizer": OPTIMIZERS,
             "qk_norm": ("none", "rms", "rms_scale"),
             "lr_decay_style": DECAY_STYLES, "dion_qr_method": ("auto", "shifted_cqr", "cqr", "rcqr", "qr"),
             "dion_scale_rule": ("fan_ratio", "spectral", "max_one", "none"),
             "dion_scalar_optimizer": ("adamw", "lion"), "ortho_dtype": ("bfloat16", "float32")}
  for field in dataclasses.fields(Config):
    flag = "--" + field.name.replace("_", "-")
    kind = field.type.split(" |")[0]
    if kind == "bool":
      action = argparse.BooleanOptionalAction if field.default else "store_true"
      parser.add_argument(flag, action=action, help=HELP[field.name])
    elif field.name == "data":
      parser.add_argument(flag, nargs="+", metavar="SPEC", help=HELP[field.name])
    else:
      parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str),
                          choices=choices.get(field.name), help=HELP[field.name])
  return parser


def parse(argv: list[str] | None = None) -> Config:
  """The run's Config from the command line (and, with ``--resume``, its saved config)."""
  given = vars(_parser().parse_args(argv))
  if "data" in given:
    given["data"] = tuple(given["data"])
  values = dict(given)
  if given.get("resume"):
    start = Config(**given)
    saved = saved_config(start.run_path, start.ckpt_path)
    values = {**saved, **given, **_kept_schedule(saved, given)}
  return Config(**values)


def _kept_schedule(saved: dict, given: dict) -> dict:
  """With ``--resume``, what keeps the saved run's data and lr schedule: a new --steps keeps
  the decay length it started with (``train.preflight.schedule_warning`` says so once the
  run starts; --lr-decay-steps stretches it), a new --global-batch-size is refused (the
  data position and consumed tokens count its steps)."""
  if "global_batch_size" in given and saved.get("global_batch_size", given["global_batch_size"]) != given["global_batch_size"]:
    raise UsageError(f"--resume --global-batch-size {given['global_batch_size']}: the run was saved with"
                     f" {saved['global_batch_size']}, and its data position and consumed tokens count steps of"
                     f" that size; resume with --global-batch-size {saved['global_batch_size']} or start a new --run-dir")
  if ("steps" in given and "lr_decay_steps" not in given and saved.get("lr_decay_steps") is None
      and saved.get("steps", given["steps"]) != given["steps"]):
    return {"lr_decay_steps": saved["steps"]}
  return {}


# Flags that describe one invocation, not the run: never taken from a saved config.
_PER_INVOCATION = ("resume", "step", "run_dir", "coordinator", "num_processes", "process_id", "distributed",
                   "distributed_timeout")


def checkpoint_record(ckpt_path: str, step: int | None = None) -> dict | None:
  """The config record (``{"train", "model", ...}``) saved with checkpoint ``step`` of
  ``ckpt_path``, or with the newest checkpoint that holds a readable one; None if none does.
  Read as the JSON file Orbax's ``JsonCheckpointHandler`` wrote, without importing jax."""
  if step is not None:
    steps = [step]
  elif os.path.isdir(ckpt_path):
    steps = sorted((int(n) for n in os.listdir(ckpt_path) if n.isdigit()), reverse=True)
  else:
    steps = []
  for s in steps:
    try:
      with open(os.path.join(ckpt_path, str(s), "config", "metadata")) as f:
        record = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(record, dict) and isinstance(record.get("train"), dict):
      return record
  return None


def saved_config(run_path: str, ckpt_path: str | None = None) -> dict:
  """The fields saved in ``run_path/config.json``, or, when it is missing or damaged, in the
  newest checkpoint of ``ckpt_path`` (default RUN_PATH/checkpoints); empty when neither
  exists. A damaged config.json without a checkpoint to stand in is a UsageError."""
  path = os.path.join(run_path, "config.json")
  try:
    with open(path) as f:
      record = json.load(f)
  except (FileNotFoundError, NotADirectoryError):  # no run yet (train.gpt names a bad --run-dir)
    record = None
  except (OSError, ValueError):
    record = {}
  if not isinstance(record, dict) or not isinstance(record.get("train"), dict):
    damaged = record is not None
    record = checkpoint_record(ckpt_path or os.path.join(run_path, "checkpoints"))
    if record is None:
      if damaged:
        raise UsageError(f"{path} is damaged (no \"train\" record) and no checkpoint holds the run's"
                         " config; restore the file from a backup or start a new --run-dir")
      return {}
  known = {f.name for f in dataclasses.fields(Config)}
  saved = {k: v for k, v in record["train"].items() if k in known and k not in _PER_INVOCATION}
  if "data" in saved:
    saved["data"] = tuple(saved["data"])
  if "weight_decay" in saved:  # Runs saved before --scalar-weight-decay decayed all alike.
    saved.setdefault("scalar_weight_decay", saved["weight_decay"])
  return saved
