"""What one training step of the repository's GPT moves and holds per device on a mesh,
on paper: the analytic half of ``python -m train.plan``.

Every number is per device and per optimizer step, for a mesh given as axis sizes
(``rp, fs, ep, cp, tp, pp``; no devices needed), so meshes far beyond this machine can be
planned. The model is this repository's implementation, as compiled by XLA's SPMD
partitioner (``models/sharding.py``, ``train/run/step.py``), not an idealized one:

- forward and backward, per micro-batch (b sequences of T tokens on each data-parallel
  rank, T/cp of them on each cp rank, A = b·T/cp·d activation bytes):
  * tp activations: the row-parallel products' partial sums reduced over tp, six per
    layer (forward, the backward pass's recomputation, which keeps only matrix
    products, and the column-parallel inputs' gradients), one for the vocab-parallel
    embedding and one for the LM head's input gradient, three float32 (b, T/cp) vectors
    for the vocab-parallel softmax; an MoE layer's experts are tensor-parallel like the
    dense MLP (each rank a slice of every expert), whose outputs are reduced per token, and
    its gates' gradient (float32, b·T/cp·k) reduced too;
  * fs gathers (ZeRO-3): each layer's tp-local kernels gathered over the dense-sharding
    axes (cp, fs, ep) in the forward pass and again in the backward pass; the embedding
    and the LM head once, over those axes (and pp, below); with cp beside fs or ep, in two steps:
    the fs·ep shard over cp, then the whole over fs·ep (``models.sharding.gathered_in_manual``);
  * gradient reductions: every tp-local gradient (float32) reduced to its shard over
    the axes that shard the parameters (cp, fs, ep; experts without ep), a reduce-scatter
    (XLA's CPU backend all-reduces, with the same payload; with cp beside fs or ep over
    fs·ep, then the shard over cp), once per micro-batch
    (ZeRO-3: the scan over micro-batches carries the shards); with rp > 1, every
    replica's sum of its shards (Dion's per-replica matrices excepted) all-reduced over
    rp once per step, after the scan (``train.run.step.make_gradient``: DDP's ``no_sync``
    during accumulation); float32 scalars: each micro-batch's loss, its mean over rp,
    and the targets' count; the gradient norm's sketch of Dion's per-replica matrices
    (``train/run/grad_norm.py``): k float32 summed over the other axes, k + 1 over rp;
  * expert all-to-all: six per MoE layer (out and back, forward, recomputation,
    backward), each carrying this rank's room for the assignments of its tokens;
  * cp exchange: K and V all-gathered over cp four times per layer, dK and dV
    reduce-scattered twice;
  * pipeline (M micro-batches, pp stages, M + pp - 1 iterations of the loop, each
    running its stage's layers, gathering their kernels and reducing their gradients to
    the fs shards, as the scan over micro-batches does): each iteration's output sent
    on, forward and backward, and the last stage's outputs scattered to the stages that
    take their loss. The embedding, final norm and LM head serve every stage: gathered
    over pp where the pipeline's ``shard_map`` begins (to their fs shards), then over fs
    once per step (every micro-batch is embedded before the pipeline); their gradients
    reduced over fs once, then summed over pp on those shards (``models.lm_loss``).
- the optimizer update (``dion_jax``'s sharded steps, ``train.run.plan.optimizer``).

Bytes are payloads as ``dion_jax.accounting`` counts them: operand bytes, output bytes
for all-gather. ``tests/test_train_plan.py`` compiles steps on 8 CPU devices and
checks these numbers against the HLO; ``tests/test_train_run_comm.py`` the trainer's whole
step (``train.run.setup.setup``'s: scan, clipping, guard, update) on every kind of mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import dion_jax
import models
from dion_jax.parallel.mesh import AXES
from models import hf
from train.run.grad_norm import SKETCH_SIZE
from train.store import hub

# Llama 3 shapes (Meta's model cards / config.json), beside the repository's presets.
LLAMA3 = {
    "1b": dict(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, mlp_dim=8192, tie_embeddings=True),
    "8b": dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336),
    "70b": dict(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, mlp_dim=28672),
    "405b": dict(num_layers=126, d_model=16384, num_heads=128, num_kv_heads=8, mlp_dim=53248),
}
LLAMA3_COMMON = dict(vocab_size=128256, mlp="swiglu", qk_norm="none", rope_base=500000.0)
PURPOSES = ("tp activations", "fs gathers", "gradient reductions", "expert all-to-all", "cp exchange",
            "pipeline activations", "dion P", "dion R", "dion orthonormalization", "dion column norms",
            "orthogonal all-to-all", "dion2 selection", "normuon norms", "replica gradient mean")


class Collective(NamedTuple):
  """One kind of collective of a step.

  Attributes:
    purpose: one of PURPOSES.
    op: the HLO opcode it is on a GPU (``dion_jax.accounting.hlo.OPS``).
    axes: the mesh axes (of size > 1) its groups span, in mesh order.
    bytes: payload per device per step (operand bytes; output bytes for all-gather).
    count: instructions per step (each pays the link's latency).
  """
  purpose: str
  op: str
  axes: tuple[str, ...]
  bytes: int
  count: int


class Step(NamedTuple):
  """How a step is cut: ``micro`` sequences per data-parallel rank and micro-batch,
  ``accum`` micro-batches per step (the pipeline's micro-batches when pp > 1)."""
  global_batch: int
  micro: int
  accum: int


def load_config(model: str | models.GPTConfig, seq_len: int | None = None, dtype: str = "bfloat16"
                ) -> models.GPTConfig:
  """``small|350m|1b|8b|70b|405b|tiny|tiny-moe``, ``hf:DIR`` (its config.json), a
  GPTConfig ``*.json`` or a GPTConfig. 1b/8b/70b/405b are Llama 3's shapes; the others the
  presets."""
  over = {"dtype": dtype} | ({"seq_len": seq_len} if seq_len else {})
  if isinstance(model, models.GPTConfig):
    return dataclasses.replace(model, **over)
  if model in LLAMA3:
    return models.GPTConfig(**{**LLAMA3_COMMON, "seq_len": 8192, **LLAMA3[model], **over})
  if model in models.PRESETS:
    return models.preset(model, **over)
  path = model
  if model.startswith("hf:"):
    path = os.path.join(hub.local_dir(model[3:], weights=False), "config.json")
  if model.startswith("hf:") and not os.path.isfile(path):
    raise ValueError(f"--model {model}: {path} does not exist; pass hf:DIR of a Hugging Face model folder (with"
                     " its config.json) or hf:ORG/NAME of the Hub")
  if not path.endswith(".json") or not os.path.isfile(path):
    names = dict.fromkeys([*models.PRESETS, *LLAMA3])  # 1b is both: Llama 3's shape is planned
    raise ValueError(f"--model {model}: expected one of {', '.join(names)}, hf:DIR (with a config.json)"
                     " or a GPTConfig .json file")
  try:
    with open(path) as f:
      record = json.load(f)
    if model.startswith("hf:") or "architectures" in record:
      # train.gpt's default length for an imported model (train/run/model_source.py)
      longest = record.get("max_position_embeddings") or 1024
      return hf.from_hf_config(record, seq_len=seq_len or min(longest, 1024), dtype=dtype)
    return models.GPTConfig(**{**record, **over})
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"--model {model}: {path} is no Hugging Face config.json or GPTConfig record ({e})") from e


def sizes_of(mesh: str | dict[str, int]) -> dict[str, int]:
  return dion_jax.parse_mesh_spec(mesh) if isinstance(mesh, str) else {a: mesh.get(a, 1) for a in AXES}


def live(sizes: dict[str, int], axes) -> tuple[str, ...]:
  """``axes`` of size > 1, in mesh order."""
  names = set(dion_jax.parallel.axis_names(*axes)) if not isinstance(axes, str) else {axes}
  return tuple(a for a in AXES if a in names and sizes[a] > 1)


def group(sizes: dict[str, int], axes: tuple[str, ...]) -> int:
  return math.prod(sizes[a] for a in axes)


class Leaf(NamedTuple):
  """One parameter: its path, global shape (blocks as (pp, layers/pp, ...)), spec, label."""
  name: str
  shape: tuple[int, ...]
  spec: P
  label: str


@functools.lru_cache(maxsize=16)
def leaves(cfg: models.GPTConfig, pp: int = 1) -> tuple[Leaf, ...]:
  """The model's parameters (abstract: nothing is allocated), with their PartitionSpecs
  and Dion labels (cached: a sweep asks for the same model on many meshes)."""
  params = models.abstract(cfg)[1]
  specs = models.param_specs(params)
  labels = dion_jax.default_labels(params)
  out = []
  for (path, x), spec, label in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                    jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
                                    jax.tree.leaves(labels)):
    shape = tuple(x.shape)
    if path[0].key == "blocks":  # (1, L, ...) -> (pp, L/pp, ...)
      if shape[1] % pp:
        raise ValueError(f"{shape[1]} layer units do not split into pp={pp} stages; choose a pp that divides")
      shape = (pp, shape[1] // pp) + shape[2:]
    out.append(Leaf(jax.tree_util.keystr(path), shape, dion_jax.parallel.padded_spec(spec, len(shape)), label))
  return tuple(out)


def local_shape(leaf: Leaf, sizes: dict[str, int]) -> tuple[int, ...]:
  out = []
  for n, entry in zip(leaf.shape, leaf.spec):
    axes = live(sizes, [entry])
    shards = group(sizes, axes)
    if n % shards:
      split = " x ".join(f"{a}={sizes[a]}" for a in axes)
      raise ValueError(f"--mesh {split}: the parameter {leaf.name}'s dimension {n} does not split into"
                       f" {shards} shards; choose sizes that divide {n}")
    out.append(n // shards)
  return tuple(out)


def local_bytes(leaf: Leaf, sizes: dict[str, int], itemsize: int = 4) -> int:
  return itemsize * math.prod(local_shape(leaf, sizes))


def step_shape(cfg: models.GPTConfig, sizes: dict[str, int], global_batch: int, micro: int | None) -> Step:
  dp = sizes["rp"] * sizes["fs"] * sizes["ep"]
  if global_batch % dp:
    raise ValueError(f"--global-batch-size {global_batch} does not split over rp·fs·ep = {dp} ranks")
  per_rank = global_batch // dp
  micro = micro or (per_rank // sizes["pp"] if sizes["pp"] > 1 else per_rank)
  if micro < 1 or per_rank % micro:
    raise ValueError(f"--micro-batch-size {micro} does not divide the {per_rank} sequences of each"
                     " data-parallel rank")
  accum = per_rank // micro
  if sizes["pp"] > 1 and accum % sizes["pp"]:
    raise ValueError(f"the pipeline needs micro-batches in multiples of pp={sizes['pp']}, got {accum}")
  if cfg.seq_len % sizes["cp"]:
    raise ValueError(f"seq_len {cfg.seq_len} does not split over cp={sizes['cp']}")
  return Step(global_batch, micro, accum)


def _moe_layers(cfg) -> int:
  return cfg.num_layers // cfg.moe_every if cfg.num_experts else 0


def _in_cp_steps(sizes: dict[str, int], axes: tuple[str, ...], nbytes: float, kind: str | None = "sharded"
                 ) -> list[tuple[tuple[str, ...], float]]:
  """A collective of ``nbytes`` over ``axes`` with cp > 1 beside fs or ep (pp = 1) runs in
  two: over cp inside the cp region and over the others outside. A dense weight's gather
  or gradient reduction (``kind`` "sharded", ``models.sharding.gathered_in_manual``)
  moves the fs·ep shard over cp and the whole over the others; a replicated one's (norm
  scales, the loss) all of it twice. Otherwise (or ``kind`` None) one collective."""
  rest = live(sizes, tuple(a for a in axes if a != "cp"))
  if kind is None or sizes["cp"] == 1 or sizes["pp"] > 1 or not rest:
    return [(live(sizes, axes), nbytes)]
  over_cp = nbytes / group(sizes, rest) if kind == "sharded" else nbytes
  return [(live(sizes, ("cp",)), over_cp), (rest, nbytes)]


def model_collectives(cfg: models.GPTConfig, sizes: dict[str, int], step: Step, params: Sequence[Leaf],
                      per_replica: bool = False) -> list[Collective]:
  """The forward and backward passes' collectives (module docstring), per step."""
  act_bytes = jnp.dtype(cfg.dtype).itemsize
  b, T, d, L = step.micro, cfg.seq_len // sizes["cp"], cfg.d_model, cfg.num_layers
  A = b * T * d * act_bytes
  out: list[Collective] = []

  def add(purpose, op, axes, nbytes, count, times=step.accum):
    axes = live(sizes, axes)
    if axes and nbytes:
      out.append(Collective(purpose, op, axes, int(nbytes * times), int(count * times)))

  dense, pp = ("cp", "fs", "ep"), sizes["pp"]
  iterations = step.accum + pp - 1 if pp > 1 else step.accum
  once = 1 if pp > 1 else step.accum  # what runs per micro-batch, or once before/after a pipeline
  add("tp activations", "all-reduce", ["tp"], 6 * L // pp * A, 6 * L // pp, times=iterations)
  # The vocab-parallel lookup: a pipeline embeds all its micro-batches at once, before it.
  add("tp activations", "all-reduce", ["tp"], A * step.accum // once, 1, times=once)
  add("tp activations", "all-reduce", ["tp"], A + 3 * b * T * 4, 4, times=step.accum // pp)
  tables, table_count = 0, 0
  for leaf in params:
    if "scale" in leaf.name:
      continue
    if leaf.name.startswith("['blocks']"):
      over = ("cp", "fs") if "experts" in leaf.name else dense
      # the kernels of this stage's layers, as used: sharded over tp (and experts over ep)
      used = local_bytes(leaf, {**sizes, "rp": 1, **{a: 1 for a in over}})
      for axes, nbytes in _in_cp_steps(sizes, over, used, None if "experts" in leaf.name else "sharded"):
        if pp > 1 and leaf.shape[1] == 1:  # XLA hoists a one-layer stage's forward gathers out of the loop
          add("fs gathers", "all-gather", axes, nbytes, 1, times=1)
          add("fs gathers", "all-gather", axes, nbytes, 1, times=iterations)
        else:
          add("fs gathers", "all-gather", axes, 2 * nbytes, 2 * leaf.shape[1], times=iterations)
    else:
      tables += local_bytes(leaf, {a: (sizes[a] if a == "tp" else 1) for a in AXES})
      table_count += 1
  # The embedding and the LM head (sharded over pp too) enter a pipeline gathered over pp.
  add("fs gathers", "all-gather", ["pp"], tables // group(sizes, live(sizes, dense)), table_count, times=1)
  for axes, nbytes in _in_cp_steps(sizes, dense, tables):
    add("fs gathers", "all-gather", axes, nbytes, table_count, times=once)
  per_micro, per_step, over_pp, over_rp = {}, {}, 0, 0
  for leaf in params:
    blocks = leaf.name.startswith("['blocks']")
    axes = ("cp", "fs") if "experts" in leaf.name else ("cp", "fs", "ep")
    # as used: the layers of this stage; the tables and the final norm whole but for tp
    nbytes = local_bytes(leaf, {**sizes, **{a: 1 for a in axes + (() if blocks else ("pp",))}})
    kind = None if "experts" in leaf.name else "replicated" if "scale" in leaf.name else "sharded"
    grad = per_micro if blocks else per_step
    for step_axes, step_bytes in _in_cp_steps(sizes, axes, nbytes, kind):
      grad[step_axes] = grad.get(step_axes, 0) + step_bytes
    if not blocks:  # the embedding, the LM head and the final norm serve every stage: summed over pp
      over_pp += local_bytes(leaf, {**sizes, "pp": 1})
    if not (per_replica and leaf.label == "dion"):
      over_rp += local_bytes(leaf, sizes)
  # Each micro-batch's gradients are reduced to the shards where they are taken (ZeRO-3):
  # the layers' in each iteration of the scan over micro-batches or of the pipeline, the
  # tables' and final norm's after the pipeline.
  for axes, nbytes in per_micro.items():
    add("gradient reductions", "reduce-scatter", axes, nbytes, 1, times=iterations)
  for axes, nbytes in per_step.items():
    add("gradient reductions", "reduce-scatter", axes, nbytes, 1, times=once)
  add("gradient reductions", "all-reduce", ["pp"], over_pp, 1, times=1)
  for axes, nbytes in _in_cp_steps(sizes, ("cp", "fs", "ep", "pp"), 4, "replicated"):
    add("gradient reductions", "all-reduce", axes, nbytes, 1)  # each micro-batch's loss
  # The targets' count, outside the cp region: the batch is split over cp only inside it.
  add("gradient reductions", "all-reduce", ("rp", "fs", "ep", "pp"), 4, 1, times=1)
  # Each replica's sums of its shards, and its loss, averaged once per step, after the scan.
  add("gradient reductions", "all-reduce", ["rp"], over_rp + 4, 1, times=1)
  if per_replica and sizes["rp"] > 1:  # the norm's sketch of Dion's per-replica gradients
    add("gradient norm sketch", "all-reduce", [a for a in sizes if a != "rp"], 4 * SKETCH_SIZE, 1, times=1)
    add("gradient norm sketch", "all-reduce", ["rp"], 4 * (SKETCH_SIZE + 1), 1, times=1)
  if cfg.num_experts:
    tokens_k = b * T * cfg.moe_top_k
    if cfg.moe_capacity_factor is None:
      rows = sizes["ep"] * tokens_k
    else:
      rows = cfg.num_experts * b * math.ceil(cfg.moe_capacity_factor * T * cfg.moe_top_k / cfg.num_experts)
    counts = 2 * cfg.num_experts * 4
    add("expert all-to-all", "all-to-all", ["ep"], _moe_layers(cfg) * (6 * rows * d * act_bytes + counts),
        8 * _moe_layers(cfg))
    # Each tp rank's experts give partial sums of the expert outputs, which meet the gates
    # before the reduction: the gates' gradient (float32, b·T·k) is reduced over tp.
    add("tp activations", "all-reduce", ["tp"], _moe_layers(cfg) * tokens_k * 4, _moe_layers(cfg),
        times=iterations)
  kv = b * cfg.seq_len * cfg.kv_heads * cfg.head_dim * act_bytes // sizes["tp"]
  add("cp exchange", "all-gather", ["cp"], L * 4 * kv, 4 * L)
  add("cp exchange", "reduce-scatter", ["cp"], L * 2 * kv, 2 * L)
  if pp > 1:
    # Each iteration sends its stage's output on, forward and backward (the last of
    # them unused, and dropped where the loop is unrolled); the last stage then scatters
    # the M/pp micro-batches of outputs to the stages that take their loss, and their
    # gradients back.
    sends = 2 * (step.accum + pp - 1) - int(cfg.unroll)
    add("pipeline activations", "collective-permute", ["pp"], (sends + 2 * (pp - 1) * step.accum // pp) * A,
        sends + 2 * (pp - 1), times=1)
  return out


def param_bytes(params: Sequence[Leaf], sizes: dict[str, int]) -> int:
  return sum(local_bytes(leaf, sizes) for leaf in params)
