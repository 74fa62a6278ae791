"""Where a run's model comes from, resolved once: a preset (initialized from ``--seed``), a
Hugging Face checkpoint (``hf:DIR``, or ``hf:ORG/NAME[@REVISION]``, fetched once into the
Hub's cache by ``train/store/hub.py``), or a checkpoint of one of our runs (``RUN_DIR``:
GRPO's starting policy, ``train.eval``'s model).

A command resolves its source first (:func:`resolve`) and asks it for everything that
depends on it: the model's configuration, the tokenizer, the weights on a mesh, and what
``config.json`` keeps of it. A missing folder, file or run is a ``UsageError``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

import models
from train.cli import UsageError
from train.run import config as config_lib
from train.run import restore as restore_lib
from train.run.config import Config
from train.store import hf as hf_io
from train.store import hub, rundir

# MoE flags that change the training, not the weights: they apply to imported models too.
_ROUTING_FLAGS = ("moe_capacity_factor", "moe_aux_loss_coeff", "moe_z_loss_coeff")
# Flag -> GPTConfig field of the flags that shape a preset.
_PRESET_FLAGS = (("num_layers", "num_layers"), ("hidden_size", "d_model"), ("num_attention_heads", "num_heads"),
                 ("seq_len", "seq_len"), ("qk_norm", "qk_norm"), ("mlp", "mlp"), ("num_experts", "num_experts"),
                 ("moe_top_k", "moe_top_k"), ("moe_every", "moe_every"), ("moe_ffn_hidden_size", "moe_mlp_dim"),
                 *((name, name) for name in _ROUTING_FLAGS))


# The flags of a preset's dense shape, which --print-config writes out.
_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_len", "qk_norm", "mlp")
# What --print-config says of the defaults that only the run decides (the machine, the data, --steps).
RESOLVED_AT_START = {
    "dtype": "float32 on CPU, bfloat16 on a GPU",
    "mesh": "fs= every device",
    "lr_decay_steps": "--steps",
    "lr_warmup_steps": "a twentieth of the decay steps",
    "vocab_size": "the data's",
    "valid_data": "stdlib:val with the embedded corpus, else none",
    "micro_batch_size": "the rank's whole share of the batch (pp micro-batches with pp > 1)",
}


def resolved_flags(cfg: Config) -> Config:
  """``cfg`` with the defaults that the flags decide written out, as ``--print-config``
  prints them: ``--lr`` (the optimizer's default), the preset's shape (not an imported
  model's, which is its checkpoint's) and Dion's ``--dion-rank-fraction`` (by the width:
  ``train.run.optim.default_rank_fraction``)."""
  from train.run import optim  # imports the optimizers: only here, for --print-config

  values = {"lr": cfg.learning_rate}
  if cfg.init_from is None:
    shape = models.preset(cfg.preset)
    fields = dict(_PRESET_FLAGS)
    values |= {flag: getattr(cfg, flag) if getattr(cfg, flag) is not None else getattr(shape, fields[flag])
               for flag in _SHAPE_FLAGS}
    if "dion_rank_fraction" in config_lib.OPTIMIZER_FLAGS[cfg.optimizer] and cfg.dion_rank_fraction is None:
      values["dion_rank_fraction"] = optim.default_rank_fraction(values["hidden_size"])
  return dataclasses.replace(cfg, **values)


def compute_settings(cfg: Config) -> dict:
  """The model's compute dtype, attention, remat, FP8 recipe and loss chunk of the flags (``--dtype``
  default: bfloat16 on GPU, float32 on CPU)."""
  dtype = cfg.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  fused = jax.default_backend() == "gpu" and dtype in ("bfloat16", "float16")
  if cfg.attention == "cudnn" and not fused:
    raise UsageError(f"--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 or float16"
                     f" (here: {jax.default_backend()}, {dtype}); use --attention xla")
  attention = ("cudnn" if fused else "xla") if cfg.attention == "auto" else cfg.attention
  return {"dtype": dtype, "attention": attention, "remat": cfg.remat, "fp8": cfg.fp8, "loss_chunk": cfg.loss_chunk}


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A resolved model source: exactly one of ``preset``, ``hf_dir`` and ``run_dir`` is set."""
  preset: str | None = None
  hf_dir: str | None = None  # a Hugging Face checkpoint's local folder, absolute
  hf_config: dict | None = None  # its config.json (a run's: that of the checkpoint it was imported from)
  run_dir: str | None = None  # a run of ours, absolute
  tokenizer_dir: str | None = None  # where its tokenizer.json lives; None: bytes
  tokenizer: Any = None  # ``data.hf_tokenizer.load`` of it

  @property
  def imported(self) -> bool:
    """The weights (and tokenizer) come from a Hugging Face checkpoint."""
    return self.hf_dir is not None

  def positions(self, seq_len: int | None) -> int:
    """The ``--seq-len`` of an imported model: ``seq_len`` (None: its max_position_embeddings,
    at most 1024), refused past the positions it was trained for."""
    longest = self.hf_config.get("max_position_embeddings")
    if seq_len and longest and seq_len > longest:
      raise UsageError(f"--seq-len {seq_len} exceeds the {longest} positions {self.hf_dir} was"
                       f" trained for (max_position_embeddings); choose at most {longest}")
    return seq_len or min(longest or 1024, 1024)

  def model_config(self, cfg: Config, vocab_size: int | None) -> models.GPTConfig:
    """The model of a new run from ``cfg``'s flags: a preset's shape with the flags' overrides
    and ``vocab_size`` (the data's), or the Hugging Face checkpoint's with ``cfg``'s
    ``--seq-len`` and MoE routing flags; computing as :func:`compute_settings` says."""
    compute = compute_settings(cfg)
    routing = {name: getattr(cfg, name) for name in _ROUTING_FLAGS if getattr(cfg, name) is not None}
    if self.imported:
      return hf_io.model_config(self.hf_dir, self.hf_config, seq_len=self.positions(cfg.seq_len), **compute, **routing)
    overrides = {"vocab_size": vocab_size, **compute, **routing}
    overrides |= {field: getattr(cfg, flag) for flag, field in _PRESET_FLAGS if getattr(cfg, flag) is not None}
    if cfg.moe_shared_expert:
      overrides["moe_shared_expert"] = True
    if cfg.mlp == "swiglu":  # a Llama or Qwen3 shape: its export has no padding rows to train
      overrides["mask_vocab_padding"] = True
    try:
      return models.preset(self.preset, **overrides)
    except ValueError as e:
      raise UsageError(str(e)) from None

  def init(self, model_cfg: models.GPTConfig, par: models.Parallelism, seed: int, resuming: bool = False
           ) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a new run on ``par``'s mesh: the checkpoint's weights, or a
    preset initialized from ``seed``; ``resuming``, the preset's initialization stands in for
    weights a checkpoint of the run replaces. Call under ``jax.set_mesh(par.mesh)``."""
    if self.imported and not resuming:
      if jax.process_index() == 0:
        print(f"reading the Hugging Face checkpoint {self.hf_dir}", flush=True)
      return hf_io.load(self.hf_dir, model_cfg, par)
    if jax.process_index() == 0:  # its compile takes seconds, before the step's: not a silent wait
      print(f"initializing the model ({model_cfg.num_params() / 1e6:.2f}M parameters" +
            (")" if resuming else f", --seed {seed})"), flush=True)
    return models.init(model_cfg, par, seed)

  def load(self, step: int | None, par: models.Parallelism | None, seq_len: int | None = None,
           picks_step: str | None = "--step") -> restore_lib.Restored:
    """The trained model as it is, on ``par``'s mesh (one device when None): checkpoint
    ``step`` of a run of ours (the latest when None: ``train.run.restore.restore``), or a
    Hugging Face checkpoint at :meth:`positions` ``(seq_len)``. Call under ``jax.set_mesh(par.mesh)``."""
    if not self.imported:
      return restore_lib.restore(self.run_dir, step, par, picks_step)
    if step is not None:
      raise UsageError("--step applies to run directories, not to hf:DIR")
    cfg = hf_io.model_config(self.hf_dir, self.hf_config, seq_len=self.positions(seq_len))
    try:
      graphdef, params = hf_io.load(self.hf_dir, cfg, par or models.Parallelism())
    except UsageError:
      raise
    except ValueError as e:
      raise UsageError(f"--mesh: {e}") from None
    return restore_lib.Restored(cfg, graphdef, params, 0)

  def record(self) -> dict:
    """What ``config.json`` keeps of the source: the ``config.json`` of the Hugging Face
    checkpoint it came from, which ``train.export`` writes back even if the folder goes."""
    return {} if self.hf_config is None else {"hf_config": self.hf_config}

  def keep_tokenizer(self, run_path: str) -> None:
    """Copies an imported checkpoint's tokenizer files into the run (``RUN_DIR/tokenizer``),
    which later commands read instead of a folder that may move."""
    if self.imported:
      hf_io.copy_tokenizer(self.hf_dir, run_path)


def resolve(init_from: str | None, preset: str | None = None, run_path: str | None = None) -> ModelSource:
  """The source of ``init_from``: ``hf:DIR`` or ``hf:ORG/NAME[@REVISION]`` (a Hub id is
  fetched here, once), a run directory, or, when None, ``preset``; with its tokenizer.
  ``run_path``: the run being trained, whose own copy of the tokenizer (once saved) wins
  over the source's."""
  own = hf_io.own_tokenizer_dir(run_path) if run_path else None
  if init_from is None:
    found = ModelSource(preset=preset, tokenizer_dir=own)
  elif init_from.startswith("hf:"):
    directory = hub.local_dir(init_from[len("hf:"):])
    found = ModelSource(hf_dir=directory, hf_config=hf_io.read_config(directory), tokenizer_dir=own or directory)
  else:
    run_dir = os.path.abspath(init_from)
    found = ModelSource(run_dir=run_dir, hf_config=(rundir.saved_record(run_dir) or {}).get("hf_config"),
                        tokenizer_dir=own or restore_lib.tokenizer_dir(run_dir))
  return dataclasses.replace(found, tokenizer=hf_io.load_tokenizer(found.tokenizer_dir))
