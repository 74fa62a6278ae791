"""What a run checks before it writes anything: its model, data, checkpoint and memory.

Each check raises ``UsageError`` with one line that names the problem and the fix
(``train/cli.py`` prints it, exit code 2); the run directory's own are ``train/store/rundir.py``'s.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator
from typing import NamedTuple

import jax
import numpy as np

import data
import models
from models import context
from train.cli import UsageError
from train.run.plan import grpo as plan_grpo
from train.run.plan import planner
from train.run import optim
from train.run.config import Config, megabatch_bytes
from train.store import rundir

# Model fields a checkpoint's arrays depend on.
_SHAPE_FIELDS = ("vocab_size", "num_layers", "d_model", "num_heads", "kv_heads", "head_dim", "d_mlp",
                 "mlp", "qk_norm", "tie_embeddings", "num_experts", "moe_every", "d_expert", "moe_shared_expert")


def check_experts(model_cfg: models.GPTConfig, mesh: jax.sharding.Mesh) -> None:
  sizes = dict(mesh.shape)
  if not model_cfg.num_experts:
    return
  if model_cfg.num_experts % sizes["ep"]:
    raise UsageError(f"--mesh ep={sizes['ep']} does not divide the {model_cfg.num_experts} experts;"
                     " choose an ep that divides the model's experts (each ep rank holds experts/ep)")


def check_model(cfg: Config, model_cfg: models.GPTConfig, mesh: jax.sharding.Mesh) -> None:
  """The model fits the flags and the mesh: QK-clip's needs, the sequence over cp, the experts over ep."""
  if cfg.qk_clip_threshold is not None:
    try:
      models.qk_clip.check(model_cfg, cfg.qk_clip_threshold)
    except ValueError as e:
      raise UsageError(f"--qk-clip-threshold: {e}") from None
  try:
    context.check_seq_len(model_cfg.seq_len, dict(mesh.shape)["cp"])
  except ValueError as e:
    raise UsageError(f"--seq-len / --mesh: {e}") from None
  check_experts(model_cfg, mesh)
  # XLA:CPU's compiler aborts the process on the experts' bfloat16 all-reduces inside their
  # shard_map (its AllReducePromotion: "Invalid binary instruction opcode copy"; jax 0.10.2,
  # tiny-moe's step on fs=2, rp=2, ep=2 and tp=2; float32 and float16 compile).
  if (model_cfg.num_experts and model_cfg.dtype == "bfloat16" and mesh.size > 1
      and mesh.devices.flat[0].platform == "cpu"):
    raise UsageError(f"--dtype bfloat16 with experts on a mesh of CPU devices (--mesh {cfg.mesh or 'fs=' + str(mesh.size)})"
                     " aborts XLA:CPU's compiler (its bfloat16 all-reduces); use --dtype float32 (the CPU's"
                     " default) or float16, or one device (--mesh fs=1)")


def check_same_model(saved: dict, model_cfg: models.GPTConfig, cfg: Config, where: str) -> None:
  # Through GPTConfig, so that records written before a field existed take its default.
  saved_cfg = models.GPTConfig(**saved["model"])
  differ = [f"{k}={getattr(saved_cfg, k)} (now {getattr(model_cfg, k)})" for k in _SHAPE_FIELDS
            if getattr(saved_cfg, k) != getattr(model_cfg, k)]
  if differ:
    raise UsageError(f"the checkpoint in {where} is of another model: {', '.join(differ)}; pass"
                     " the model flags it was saved with (--resume reuses them when left off)"
                     " or start a new --run-dir")
  if saved["train"]["optimizer"] != cfg.optimizer:
    raise UsageError(f"the checkpoint in {where} holds --optimizer {saved['train']['optimizer']}"
                     f" state, not {cfg.optimizer}; resume with --optimizer"
                     f" {saved['train']['optimizer']} or start a new --run-dir")


def check_token_ids(flag: str, source, vocab_size: int, fix: str | None = None) -> None:
  """Raises UsageError when ``source`` holds a token id at or past ``vocab_size``; the
  message names the largest id and ``fix`` (default: a large enough --vocab-size)."""
  largest = data.max_token_id(source)
  if largest >= vocab_size:
    fix = fix or f"pass --vocab-size {largest + 1} or more, or data made with the model's tokenizer"
    raise UsageError(f"{flag} {source.name} holds token id {largest} but the model's vocabulary has"
                     f" {vocab_size} ids (0..{vocab_size - 1}); {fix}")


def check_data(cfg: Config, model_cfg: models.GPTConfig, source, valid_source, eod: int | None,
               imported: bool) -> None:
  """Every data source fits the model's vocabulary (an ``imported`` one's: the data must be
  made with its tokenizer), and the validation data holds a row."""
  fix = ("tokenize the data with --init-from's tokenizer (python -m data.convert tokenize"
         " --tokenizer DIR)" if imported else None)
  if imported and isinstance(source, data.SFTSource):  # read here, with the checkpoint's tokenizer or bytes
    fix = ("sft: files are read with the checkpoint's tokenizer.json, else as bytes (ids 0..256):"
           " put its tokenizer.json beside config.json")
  check_token_ids("--data", source, model_cfg.vocab_size, fix)
  if valid_source is None or cfg.eval_tokens == 0:
    return
  check_token_ids("--valid-data", valid_source, model_cfg.vocab_size, fix)
  try:
    data.ordered_rows(valid_source, seq_len=model_cfg.seq_len, limit=1, eod=eod)
  except data.DataError as e:
    raise UsageError(f"--valid-data: {e}; pass more validation data, a smaller --seq-len,"
                     " or --eval-tokens 0 for no validation") from None


# ``damaged``'s command for train.grpo --resume's --init-from checkpoint: the step the run
# started from (its config.json's init_step), which no flag changes.
RESUMED_START = "the step the resumed run started from"


def damaged(command: str | None, ckpt_path: str, step: int | None, error: BaseException) -> UsageError:
  """The one-line error of a checkpoint that does not restore: its step, the cause, and
  the way back to an older one (``command`` is the flags that pick a step: ``--resume --step``
  in train.gpt, ``--step`` in train.eval and train.export; None where no flag picks one:
  train.grpo's ``--init-from`` takes a run's latest checkpoint; :data:`RESUMED_START` where
  the step is fixed: a resumed train.grpo run's start, which only a new run leaves)."""
  existing = rundir.existing_steps(ckpt_path)
  step = max(existing, default=0) if step is None else step
  # The library's first line, cut short: its full text (paths, codes) can run to many lines.
  cause = f"{type(error).__name__}: {error}".split(" See full")[0].splitlines()[0]
  cause = cause if len(cause) <= 120 else cause[:119] + "…"
  older = [s for s in existing if s < step]
  # train.eval, train.sample and train.export have no --run-dir: the way on is a new training run
  start_again = ("start a new --run-dir" if command and command.startswith("--resume")
                 else "train a new run with python -m train.gpt")
  damaged_step = os.path.join(ckpt_path, str(step))
  if command == RESUMED_START:
    fix = (f"--resume reads the step its run started from: put back an intact copy of {damaged_step}, or start"
           " a new run (another --run-dir, without --resume) " + (
               f"from step {max(older)}: move {damaged_step} out of {ckpt_path} (--init-from takes a run's latest"
               " checkpoint)" if older else f"from another --init-from ({ckpt_path} has no older checkpoint)"))
  elif not older:
    fix = f"no older checkpoint exists: {start_again}"
  elif command is None:
    fix = (f"--init-from takes a run's latest checkpoint: move {damaged_step} out of"
           f" {ckpt_path} to start from step {max(older)}")
  else:
    fix = f"use an older one with {command} {max(older)}"
  return UsageError(f"the checkpoint of step {step} in {ckpt_path} is damaged ({cause}); {fix}")


@contextlib.contextmanager
def reading(command: str | None, ckpt_path: str, step: int | None) -> Iterator[None]:
  """Reads of checkpoint ``step`` (Orbax's restores and metadata, the saved records): the
  errors damage gives them become :func:`damaged`'s one line; any other error (a bug)
  keeps its traceback. Damage is a missing item or file (KeyError, OSError), bytes or
  JSON that do not parse (ValueError), or a failed TensorStore read, which Orbax re-raises
  as a bare ``Exception``."""
  # A read that fails leaves Orbax's others behind: TensorStore finishes them after Orbax has
  # closed its event loop, during the failure and after it, and reports each one's "Event loop
  # is closed" through sys.unraisablehook, whose default printed dozens of tracebacks around
  # the one error line. Those are dropped while reading and, after damage, for good.
  previous = sys.unraisablehook

  def hook(unraisable) -> None:
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  except UsageError:
    raise
  except (KeyError, ValueError, OSError) as e:
    raise damaged(command, ckpt_path, step, e) from None
  except Exception as e:
    if type(e) is not Exception:
      sys.unraisablehook = previous
      raise
    raise damaged(command, ckpt_path, step, e) from None
  sys.unraisablehook = previous


def check_memory(stats, mesh: jax.sharding.Mesh, model_cfg: models.GPTConfig, cfg: Config | None = None,
                 grpo: plan_grpo.GRPO | None = None) -> None:
  """Refuses a compiled training step whose memory (XLA's ``memory_analysis``: arguments,
  outputs and temporaries of one device) exceeds a device's memory, or, on CPU, whose
  devices together exceed the host's; a backend that reports neither is not checked. With
  the run's ``cfg`` the refusal names what would fit on this mesh (:func:`what_fits`; with
  ``grpo``, the shape of GRPO's update)."""
  if stats is None:
    return
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  need = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
          + stats.temp_size_in_bytes)
  capacity = device_capacity(local)
  if capacity is None:
    return
  limit, devices, where = capacity
  if need * devices > limit:
    fits = None if cfg is None else what_fits(cfg, model_cfg, dict(mesh.shape), need, limit // devices, grpo)
    if fits is not None:
      advice = (f"{fits.flags} fits on this mesh by the planner (about {planner.size(fits.estimate)} a device); python -m"
                " train.plan --sweep names other meshes")
    else:
      advice = ("lower --seq-len or --micro-batch-size, choose a --remat policy (full keeps least), add"
                " --offload-optimizer, or shard over more devices (--mesh); python -m train.plan --sweep"
                " names the fastest that fits")
    raise UsageError(f"a training step needs {need * devices / 2**30:,.1f} GiB, more than {where}"
                     f" (--seq-len {model_cfg.seq_len}); {advice}")


def device_capacity(local: list[jax.Device]) -> tuple[int, int, str] | None:
  """What this process's ``local`` devices hold: (bytes, devices sharing them, in words).
  A GPU's own memory; CPU devices share the host's; None where the backend reports neither."""
  device = local[0]  # memory_stats answers for this process's devices only
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if limit is not None:
    return limit, 1, f"the {limit / 2**30:.1f} GiB of a {device.device_kind}"
  if device.platform == "cpu":
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = host_free()
    shared = f" ({len(local)} CPU devices)" if len(local) > 1 else ""
    if free is None or free >= total:
      return total, len(local), f"the host's {total / 2**30:.1f} GiB{shared}"
    return free, len(local), f"the {free / 2**30:.1f} GiB the host has free for this process (of {total / 2**30:.1f} GiB){shared}"
  return None


def host_free() -> int | None:
  """The bytes this process may hold on the host: what it holds (its resident set) and what the
  kernel reports available (MemAvailable); None where /proc does not say. The whole RAM overstated
  it: a step that fitted the host's 23.5 GiB was killed by the kernel's out-of-memory killer."""
  try:
    with open("/proc/meminfo") as f:
      available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    with open("/proc/self/statm") as f:
      resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, StopIteration, ValueError, IndexError):
    return None
  return available + resident


class Fit(NamedTuple):
  """Flags that make a step fit, and its planned bytes a device."""
  flags: str
  estimate: int


def what_fits(cfg: Config, model_cfg: models.GPTConfig, sizes: dict[str, int], need: int, limit: int,
              grpo: plan_grpo.GRPO | None = None) -> Fit | None:
  """The planner's fastest recompute policy, optimizer offload, (Dion on tp > 1) split of
  Q over tp and (Dion) update chunks (``--megabatch-mib``, the run's or
  ``planner.MEGABATCH_MIB``) whose step fits ``limit`` bytes per device on this mesh, as flags (None: none
  fits); with ``grpo`` the step is GRPO's
  update (the planner's, beside the reference policy where beta > 0). The compiled step
  needs ``need`` bytes: each choice's planned memory is scaled by ``need`` over the plan of
  the run's own choice, so the planner's margin over the compiler
  (tests/test_train_run_plan_memory.py) does not hide a fit."""
  def planned(remat: str, offload: bool, split_q: bool, mib: float) -> dict:
    return planner.plan_run(cfg, model_cfg, sizes, grpo, remat=remat, offload_optimizer=offload, split_q=split_q,
                            megabatch_bytes=megabatch_bytes(mib))

  scale = need / planned(model_cfg.remat, cfg.offload_optimizer, cfg.dion_split_q,
                         cfg.megabatch_mib)["memory"]["device_total"]
  splits = {cfg.dion_split_q, cfg.optimizer == "dion" and sizes["tp"] > 1}
  chunks = {cfg.megabatch_mib, cfg.megabatch_mib or planner.MEGABATCH_MIB if cfg.optimizer == "dion" else 0}
  fitting = []
  for remat, offload, split_q, mib in itertools.product(planner.remat_policies(), (False, True), sorted(splits),
                                                        sorted(chunks)):
    p = planned(remat, offload, split_q, mib)
    if p["memory"]["device_total"] * scale <= limit:
      fitting.append((p["time"]["step"], remat, offload, split_q, mib, p["memory"]["device_total"] * scale))
  if not fitting:
    return None
  _, remat, offload, split_q, mib, estimate = min(fitting)
  return Fit(" ".join([f"--remat {remat}"] + ["--offload-optimizer"] * offload + ["--dion-split-q"] * split_q
                      + [f"--megabatch-mib {mib:g}"] * bool(mib)), estimate)


def _kept_schedule(cfg: Config, saved_train: dict) -> bool:
  """Whether ``--resume`` with a new --steps kept the saved run's lr decay length
  (``train.run.config``'s ``_kept_schedule``)."""
  return saved_train.get("lr_decay_steps") is None and cfg.lr_decay_steps == saved_train.get("steps") != cfg.steps


def _resumed_lr(cfg: Config, start_step: int) -> np.ndarray:
  """The learning rates of steps ``start_step + 1 .. --steps``, in order."""
  return np.asarray(optim.schedule(cfg)(np.arange(start_step, cfg.steps)))


def check_schedule(cfg: Config, start_step: int, saved_train: dict) -> None:
  """Refuses a ``--resume`` whose kept lr schedule has decayed to 0 before the new steps:
  they would train at learning rate 0, changing nothing."""
  if cfg.resume and _kept_schedule(cfg, saved_train) and _resumed_lr(cfg, start_step).max() == 0:
    raise UsageError(f"--resume --steps {cfg.steps}: the run's lr schedule decayed to 0 by step"
                     f" {cfg.lr_decay_steps}, so steps {start_step + 1}..{cfg.steps} would train at learning"
                     f" rate 0; pass --lr-decay-steps {cfg.steps} to stretch the schedule over the new"
                     " length (or a --min-lr above 0)")


def schedule_warning(cfg: Config, saved_train: dict, start_step: int) -> None:
  """One line when ``--resume`` with a new --steps kept the saved run's lr decay length."""
  if _kept_schedule(cfg, saved_train):
    lr = _resumed_lr(cfg, start_step)
    # The first and last step's, in order (steps still in warmup rise), and a peak between them.
    rate = f"{lr[0]:.3E}" if lr.min() == lr.max() else f"{lr[0]:.3E} to {lr[-1]:.3E}"
    rate += f" (at most {lr.max():.3E})" if lr.max() > max(lr[0], lr[-1]) else ""
    print(f"warning: --resume --steps {cfg.steps} keeps the run's lr schedule, which decays over"
          f" {cfg.lr_decay_steps} steps: steps {start_step + 1}..{cfg.steps} train at learning rate {rate};"
          f" pass --lr-decay-steps {cfg.steps} to stretch it over the new length instead", file=sys.stderr)
