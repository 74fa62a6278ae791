"""How the GPT lies on the (rp, fs, cp, tp, pp) mesh: logical axes, parameter specs, layer stacks.

TP, SP and FS are sharding annotations that XLA's SPMD partitioner turns into
collectives; PP and CP are explicit (``models/pipeline.py``, ``models/context.py``: a
``shard_map`` manual over ``pp`` and ``cp``).

- Parameters carry the PartitionSpecs of :func:`param_specs` (Megatron's layouts in Flax's
  (fan_in, fan_out) kernel order): column-parallel ``P('fs', 'tp')`` for query, key, value,
  MLP-up and the LM head (vocab-parallel), row-parallel ``P('tp', 'fs')`` for attention-out
  and MLP-down, the embedding vocab-parallel; norm scales replicated. The embedding and
  the LM head are used whole on every stage of a pipeline, so their d_model dimension is
  sharded over ``pp`` as well as ``fs`` (``P('tp', ('fs', 'pp'))``, ``P(('fs', 'pp'), 'tp')``):
  gathered where used like any FS weight, they cost 1/pp of the memory on each stage.
  Stacked block parameters have leading (stage, layer) axes, the stage axis on ``pp``.
- FS (ZeRO-3): inside the layer scan, :meth:`Parallelism.weight` pins each layer's kernel
  to its stored layout and then constrains it to its tp sharding alone, so the partitioner
  all-gathers that one layer over ``fs`` where it is used, gathers it again in the
  backward pass (``models.gpt.apply_layers`` keeps only matrix products), and reduces
  its gradient back to the fs shards.
- TP: activations between the column- and row-parallel products are constrained to
  heads or MLP features over ``tp``; the row-parallel product's partial sums are reduced
  where its output is constrained back to the residual layout.
- SP (``sequence_parallel``): the residual stream is constrained to the sequence over
  ``tp``, so that reduction becomes a reduce-scatter and the input of the next
  column-parallel product an all-gather (Megatron's sequence parallelism).
- DP: the batch over ``rp`` and ``fs``.
- CP: the sequence split over ``cp`` inside ``models.loss``'s ``shard_map``, so no
  activation constraint names it. To the parameters cp is one more data-parallel axis:
  dense weights are stored sharded over it as over fs (ZeRO-3 over cp, as Megatron's
  distributed optimizer shards over data-parallel and cp ranks): each enters the
  ``shard_map`` as its cp block and is gathered where used (:meth:`Parallelism.weight`),
  its gradient reduce-scattered back; the optimizers' state and work are split over cp
  like the weights.

Logical names map to mesh axes in one table (:data:`LOGICAL_AXES`); axes that are manual
in the surrounding ``shard_map`` (``rp`` under per-replica gradients, ``pp`` in the
pipeline, ``cp``) are dropped from activation constraints there.

Layer stacks. Block parameters are stored ``(stages, layers_per_stage, ...)`` with
``stages = pp · virtual_stages``; with a circular schedule, execution stage
``s = repeat·pp + device`` lives on ``device``, so storage position
``device·virtual_stages + repeat`` holds execution stage s, and the stage axis shards on
``pp`` in contiguous blocks. :func:`to_stages` and :func:`to_layers` convert between that
and the canonical layer order ``(num_layers, ...)``, which is the same on every mesh.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dion_jax import parallel

# The data-parallel axes, over which the global batch is split (ep's ranks are
# data-parallel to everything but the experts).
BATCH_AXES = ("rp", "fs", "ep")
# Logical activation axes -> mesh axes. "seq" is on tp only with sequence parallelism.
LOGICAL_AXES = {
    "batch": BATCH_AXES,
    "heads": "tp",
    "mlp": "tp",
    "vocab": "tp",
    "seq": "tp",
}

# What a dense weight is sharded over besides tp: fs; ep, whose ranks are data-parallel
# ranks to everything but the experts; and cp, whose ranks are data-parallel ranks to every
# parameter (fully sharded over all of them, as FSDP). cp comes first: the shard_map manual
# over cp (``models.lm_loss``) takes each rank's contiguous block and gathers it inside.
DENSE_SHARDS = ("cp", "fs", "ep")
# Each kernel's Megatron layout, and the sharding it is used in (gathered over cp, fs and ep).
KERNEL_LAYOUTS = {
    "column": (P(DENSE_SHARDS, "tp"), P(None, "tp")),
    "row": (P("tp", DENSE_SHARDS), P("tp", None)),
    # The MoE router [D, E]: too narrow to split over tp.
    "router": (P(DENSE_SHARDS, None), P(None, None)),
}
# An expert stack's [E, fan_in, fan_out]: experts over ep, then a column- or row-parallel
# kernel over cp·fs and tp (cp's ranks are data-parallel to the experts too).
EXPERT_LAYOUTS = {"column": P("ep", ("cp", "fs"), "tp"), "row": P("ep", "tp", ("cp", "fs"))}
# The experts' amax histories [E, kernels, 3, H] (``--fp8 delayed``): each rank its experts'.
HISTORY_LAYOUT = P("ep", None, None, None)


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """The mesh and the parallel options of one model.

  Attributes:
    mesh: the (rp, fs, cp, tp, pp) mesh, or None for one device without annotations.
    sequence_parallel: shard the residual stream's sequence over ``tp`` (needs tp > 1
      to matter).
    microbatches: micro-batches per step of the pipeline (pp > 1); a multiple of pp.
    virtual_stages: stages per device of a circular pipeline (1: GPipe).
  """

  mesh: jax.sharding.Mesh | None = None
  sequence_parallel: bool = False
  microbatches: int = 1
  virtual_stages: int = 1

  def __post_init__(self):
    if self.microbatches < 1 or self.virtual_stages < 1:
      raise ValueError(
          f"microbatches ({self.microbatches}) and virtual_stages ({self.virtual_stages})"
          " must be positive")
    if self.pp > 1 and self.microbatches % self.pp:
      raise ValueError(
          f"the pipeline needs micro-batches in multiples of pp={self.pp}, got"
          f" {self.microbatches}; change the micro-batch size or the global batch")
    if self.pp == 1 and self.virtual_stages > 1:
      raise ValueError("virtual_stages > 1 needs a pipeline (pp > 1); drop it or set pp")

  def size(self, axis: str) -> int:
    return 1 if self.mesh is None else dict(self.mesh.shape)[axis]

  @property
  def pp(self) -> int:
    return self.size("pp")

  @property
  def tp(self) -> int:
    return self.size("tp")

  @property
  def cp(self) -> int:
    return self.size("cp")

  @property
  def stages(self) -> int:
    """Stages of the layer stack: pp · virtual_stages."""
    return self.pp * self.virtual_stages

  def spec(self, *names: str | None) -> P:
    """The PartitionSpec of an activation with logical axes ``names`` here.

    Axes that the surrounding ``shard_map`` made manual are left out.
    """
    def resolve(name):
      if name is None or (name == "seq" and not self.sequence_parallel):
        return None
      return LOGICAL_AXES[name]

    return without_manual(P(*(resolve(n) for n in names)))

  def constrain(self, x: jax.Array, *names: str | None) -> jax.Array:
    """``x`` with the sharding of the logical axes ``names`` (nothing on one device)."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.spec(*names))

  def weight(self, kernel: jax.Array, layout: str) -> jax.Array:
    """A layer's kernel where it is used: its tp sharding, gathered over cp, fs and ep.

    Constraining to the stored layout first keeps the gradient (the transpose of the
    gather) in that layout: reduced to fs shards, not all-reduced to full copies. Inside
    the ``shard_map`` manual over cp the kernel is this rank's cp block (``models.lm_loss``),
    gathered over cp there, keeping its tp sharding, then over fs and ep
    (:func:`gathered_in_manual`); the gathers' transposes reduce-scatter the gradient.
    """
    if self.mesh is None:
      return kernel
    stored, used = KERNEL_LAYOUTS[layout]
    if _gathers_manual_axes(stored):
      return gathered_in_manual(kernel, stored, used)
    kernel = jax.lax.with_sharding_constraint(gathered_over_manual(kernel, stored), without_manual(stored))
    return jax.lax.with_sharding_constraint(kernel, used)


def manual_axes() -> set[str]:
  """The mesh axes that the surrounding ``shard_map`` (or nested ones) made manual."""
  return set(jax.sharding.get_abstract_mesh().manual_axes)


def in_auto_axes(f, in_spec: P, out_spec: P):
  """``f`` run inside a ``shard_map`` manual over the mesh axes that are still automatic,
  its argument laid out over them as ``in_spec``, its result as ``out_spec``.

  Inside a ``shard_map`` manual over some axes (cp), a collective over those axes makes
  XLA's partitioner replicate its operand over the automatic ones first (on CPU, jax
  0.10: every weight gathered over tp, keys and values over tp and the batch axes, and
  the transposes' cotangents likewise). Made manual over all axes, each device moves
  only its own shard, and the collective's transpose keeps that sharding.
  """
  auto = set(jax.sharding.get_abstract_mesh().axis_names) - manual_axes()
  return jax.shard_map(f, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_spec, out_specs=out_spec,
                       axis_names=auto)


def _gathers_manual_axes(stored: P) -> bool:
  """Whether a weight stored as ``stored`` entered the ``shard_map`` as a block of manual axes (cp)."""
  sizes, manual = jax.sharding.get_abstract_mesh().shape, manual_axes()
  return any(a in manual and sizes[a] > 1 for e in stored for a in parallel.axis_names(e))


def gathered_in_manual(kernel: jax.Array, stored: P, used: P) -> jax.Array:
  """A weight stored as ``stored`` that entered a ``shard_map`` manual over some of its
  axes (cp) as its block, in its layout ``used``: gathered over those axes inside
  :func:`in_auto_axes`, then over the automatic ones (fs, ep) by the partitioner, so that
  it stays sharded over tp throughout and its gradient is reduce-scattered over fs, then
  cp, from its tp shards.

  The block of a dimension stored over (cp, fs) is cp-major: device (c, f) holds its
  block c·F + f. Gathered over cp alone it holds blocks f, F + f, ...: the f-th shard
  over fs of the weight with its blocks in (f, c) order, whose gather over fs is put
  back into (c, f) order locally."""
  manual = manual_axes()
  sizes = jax.sharding.get_abstract_mesh().shape

  def gather(block):  # here every axis is manual: gather over the outer ones (cp) alone
    for dim, entry in enumerate(stored):
      over = tuple(a for a in parallel.axis_names(entry) if a in manual)
      if over:
        block = jax.lax.all_gather(block, over, axis=dim, tiled=True)
    return block

  auto_stored = _without_unit(without_manual(stored))
  kernel = in_auto_axes(gather, auto_stored, auto_stored)(kernel)
  kernel = jax.lax.with_sharding_constraint(kernel, without_manual(stored))
  kernel = jax.lax.with_sharding_constraint(kernel, without_manual(used))
  for dim, entry in enumerate(stored):
    names = parallel.axis_names(entry)
    m = math.prod(sizes[a] for a in names if a in manual)
    f = math.prod(sizes[a] for a in names if a not in manual)
    if m > 1 and f > 1:
      shape = kernel.shape
      blocks = kernel.reshape(*shape[:dim], f, m, shape[dim] // (f * m), *shape[dim + 1:])
      kernel = jnp.swapaxes(blocks, dim, dim + 1).reshape(shape)
  return jax.lax.with_sharding_constraint(kernel, without_manual(used))


def _without_unit(spec: P) -> P:
  """``spec`` without the mesh axes of size 1."""
  sizes = jax.sharding.get_abstract_mesh().shape

  def entry(e):
    axes = tuple(a for a in parallel.axis_names(e) if sizes[a] > 1)
    return axes[0] if len(axes) == 1 else (axes or None)

  return P(*(entry(e) for e in spec))


def without_manual(spec: P) -> P:
  """``spec`` without the axes that the surrounding ``shard_map`` made manual."""
  manual = manual_axes()

  def entry(e):
    axes = tuple(a for a in parallel.axis_names(e) if a not in manual)
    return axes[0] if len(axes) == 1 else (axes or None)

  return P(*(entry(e) for e in spec))


def gathered_over_manual(kernel: jax.Array, stored: P) -> jax.Array:
  """A weight stored as ``stored``, inside a ``shard_map`` manual over some of its axes
  (cp) where it entered as its block: all-gathered over those axes."""
  manual = manual_axes()
  for dim, entry in enumerate(stored):
    over = tuple(a for a in parallel.axis_names(entry) if a in manual)
    if over:
      kernel = jax.lax.all_gather(kernel, over, axis=dim, tiled=True)
  return kernel


def param_specs(params: Any) -> Any:
  """The PartitionSpec of every parameter of the GPT's pure-dict tree."""

  def spec(path, leaf):
    names = [str(getattr(k, "key", k)) for k in path]
    if names[0] == "embed":
      return P("tp", (*DENSE_SHARDS, "pp"))
    if names[0] == "lm_head":
      return P((*DENSE_SHARDS, "pp"), "tp")
    if names[-1] == "fp8_history":  # models.fp8.History: a few floats, on every rank (but pp's, ep's)
      base = HISTORY_LAYOUT if "experts" in names else P(None, None)
    elif names[-1] == "scale":
      base = parallel.vector()
    elif "experts" in names:
      base = EXPERT_LAYOUTS[layout_of(names)]
    else:
      base = KERNEL_LAYOUTS[layout_of(names)][0]
    if names[0] != "blocks":
      return base
    # [stages, units, ...]; a Group's dense layers have one more stack axis.
    return parallel.stacked(base, 3 if names[1] == "dense" else 2)

  return jax.tree_util.tree_map_with_path(spec, params)


_ROW_PARALLEL = ("out", "down")


def layout_of(names: list[str]) -> str:
  """The :data:`KERNEL_LAYOUTS` (:data:`EXPERT_LAYOUTS`) key of the weight at path ``names``."""
  if "router" in names:
    return "router"
  return "row" if any(n in _ROW_PARALLEL for n in names) else "column"


def shardings(mesh: jax.sharding.Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _stage_permutation(pp: int, virtual_stages: int) -> np.ndarray:
  """perm[storage position] = execution stage (see the module docstring)."""
  device, repeat = np.divmod(np.arange(pp * virtual_stages), virtual_stages)
  return repeat * pp + device


def to_stages(layers: Any, pp: int, virtual_stages: int = 1) -> Any:
  """Leaves ``(num_layers, ...)`` in layer order -> ``(stages, layers_per_stage, ...)``."""
  stages = pp * virtual_stages
  perm = _stage_permutation(pp, virtual_stages)

  def f(x):
    if x.shape[0] % stages:
      raise ValueError(
          f"{x.shape[0]} layers do not split into {stages} pipeline stages"
          f" (pp={pp} x virtual_stages={virtual_stages}); choose sizes that divide it")
    return x.reshape(stages, x.shape[0] // stages, *x.shape[1:])[perm]

  return jax.tree.map(f, layers)


def to_layers(stacked: Any, pp: int, virtual_stages: int = 1) -> Any:
  """Inverse of :func:`to_stages`: ``(stages, layers_per_stage, ...)`` -> layer order."""
  order = np.argsort(_stage_permutation(pp, virtual_stages))
  return jax.tree.map(lambda x: x[order].reshape(math.prod(x.shape[:2]), *x.shape[2:]), stacked)
