"""The named device mesh (rp, fs, ep, cp, tp, pp) and the PartitionSpecs of standard layouts.

Axis meanings (Megatron-Dion's names, docs/design.md §3):
  rp: data-parallel replicas that hold the same parameter shard.
  fs: data-parallel ranks among which parameters and optimizer state are sharded.
  ep: expert parallelism: each rank holds 1/ep of every layer's experts, and tokens travel
      to their experts by all-to-all; to every other parameter, one more data-parallel axis
      (as Megatron's EP reuses data-parallel ranks), which the GPT shards over with fs.
  cp: context parallelism: each sequence split over cp ranks; to the parameters and
      their optimizer state, one more data-parallel axis, which the GPT shards over with fs.
  tp: tensor parallelism (Megatron column/row-parallel layers).
  pp: pipeline stages; stacked stage weights carry a leading axis sharded on pp.

Layouts are in Flax's kernel layout, (fan_in, fan_out): a column-parallel kernel
splits fan_out over tp and fan_in over fs, a row-parallel kernel the reverse.

Typical use::

  mesh = make_mesh("rp=1,fs=2,tp=2")
  check_divisible(kernel.shape, column_parallel(), mesh, name="mlp/up")
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Row-major device order: later axes are closer devices; ep, cp and tp, which communicate
# activations in every layer, come after the data-parallel axes (Megatron's tp-cp-ep-dp order).
AXES = ("rp", "fs", "ep", "cp", "tp", "pp")
REPLICA_AXIS = "rp"
TENSOR_PARALLEL_AXIS = "tp"

# XLA flags for a program whose shard_maps nest with the inner one's axes before the outer
# one's in AXES (the GPT's pipeline over pp, or its context parallelism over cp, around the
# shard_maps of its layers over the other axes). From jaxlib 0.11, XLA
# exports shardings in its named form ("HLO sharding V3"), whose check of a nested manual
# computation's axes aborts the process ("Manual axes must be sorted by mesh axis index",
# jaxlib 0.11.2 and 0.12.0.1, CPU). Off, as jaxlib 0.10 has it; every jaxlib from 0.10.2 to
# 0.12 knows the flag. XLA reads XLA_FLAGS once, when JAX's first backend starts: the
# trainer adds these before that, as the tests do.
NESTED_SHARD_MAP_XLA_FLAGS = {"--xla_enable_hlo_sharding_v3": "false"}

_SIZE_RE = re.compile(r"[0-9]+")


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
  """``{"rp": 1, "fs": 2, ...}`` (or a Mesh's shape) -> ``"rp=1,fs=2,ep=1,cp=1,tp=1,pp=1"``."""
  return ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes)


def axis_names(*entries: Any) -> tuple[str, ...]:
  """The mesh axes named by PartitionSpec entries (None, a name, or a tuple of names)."""
  names: list[str] = []
  for entry in entries:
    if entry is None or entry is P.UNCONSTRAINED:
      continue
    names += [entry] if isinstance(entry, str) else list(entry)
  return tuple(names)


def padded_spec(spec: P, ndim: int) -> P:
  """``spec`` with None entries appended up to ``ndim`` entries."""
  return P(*(tuple(spec) + (None,) * (ndim - len(spec))))


def partition_specs_of(tree: Any) -> Any:
  """The PartitionSpec of every array of ``tree``, read from its ``NamedSharding``."""

  def spec(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      raise ValueError(
          f"cannot read a PartitionSpec from a {type(x).__name__} with sharding {sharding};"
          " pass partition_specs explicitly")
    return sharding.spec

  return jax.tree.map(spec, tree)


def _check_size(where: str, axis: str, value: Any) -> int:
  if isinstance(value, str):
    ok = _SIZE_RE.fullmatch(value) is not None and int(value) > 0
  else:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0
  if not ok:
    raise ValueError(
        f"{where}: size of axis {axis!r} must be a positive integer, got {value!r};"
        f" write e.g. '{axis}=2'")
  return int(value)


def _check_axis(where: str, axis: str, seen: set[str]) -> None:
  if axis not in AXES:
    raise ValueError(
        f"{where}: unknown axis {axis!r}; use only {', '.join(AXES)}"
        f" (e.g. 'rp=1,fs=2,tp=2')")
  if axis in seen:
    raise ValueError(f"{where}: axis {axis!r} is given twice; give each axis at most once")
  seen.add(axis)


def parse_mesh_spec(spec: str) -> dict[str, int]:
  """Parses a mesh spec like ``"rp=1,fs=2,tp=2"`` into sizes for all of AXES.

  Axes left out have size 1; whitespace around names and sizes is ignored;
  ``""`` gives all sizes 1.

  Args:
    spec: comma-separated ``axis=size`` items, axes from AXES, sizes >= 1.

  Returns:
    A dict with one entry per axis of AXES, in that order.

  Raises:
    ValueError: one line naming the fix, for an unknown axis, a repeated axis,
      an item without ``=``, or a size that is not a positive integer.
  """
  where = f"mesh spec {spec!r}"
  sizes = dict.fromkeys(AXES, 1)
  seen: set[str] = set()
  for item in spec.split(","):
    item = item.strip()
    if not item:
      continue
    axis, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"{where}: item {item!r} is not axis=size; write e.g. 'fs=2'")
    axis = axis.strip()
    _check_axis(where, axis, seen)
    sizes[axis] = _check_size(where, axis, value.strip())
  return sizes


def _sizes_of(spec: str | Mapping[str, int]) -> dict[str, int]:
  if isinstance(spec, str):
    return parse_mesh_spec(spec)
  where = f"mesh sizes {dict(spec)!r}"
  sizes = dict.fromkeys(AXES, 1)
  seen: set[str] = set()
  for axis, value in spec.items():
    _check_axis(where, axis, seen)
    sizes[axis] = _check_size(where, axis, value)
  return sizes


def make_mesh(spec: str | Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """Builds a Mesh with axes AXES (size-1 axes included) and Auto axis types.

  Args:
    spec: a mesh spec string (see parse_mesh_spec) or a mapping axis -> size.
    devices: the devices to lay out, in row-major mesh order; all of
      ``jax.devices()`` when None.

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(rp, fs, ep, cp, tp, pp)``.

  Raises:
    ValueError: for a bad spec, or when the product of the sizes differs from
      the number of devices.
  """
  sizes = _sizes_of(spec)
  shape = tuple(sizes[a] for a in AXES)
  available = jax.devices() if devices is None else list(devices)
  if math.prod(shape) != len(available):
    need = math.prod(shape)
    if need < len(available):
      hint = f", or pass devices=jax.devices()[:{need}]"
    elif available and available[0].platform == "cpu":
      hint = (f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={need}"
              f" set before jax is imported gives {need} devices)")
    else:
      hint = ""
    raise ValueError(
        f"mesh {format_mesh_spec(sizes)} needs {need} devices but {len(available)} exist;"
        f" choose sizes whose product is {len(available)}{hint}")
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  if devices is None:
    return jax.make_mesh(shape, AXES, axis_types=axis_types)
  return jax.sharding.Mesh(np.array(available).reshape(shape), AXES, axis_types=axis_types)


def column_parallel() -> P:
  """Column-parallel kernel (fan_in, fan_out): fan_in over fs, fan_out over tp."""
  return P("fs", "tp")


def row_parallel() -> P:
  """Row-parallel kernel (fan_in, fan_out): fan_in over tp, fan_out over fs."""
  return P("tp", "fs")


def embedding() -> P:
  """Embedding table (vocab, d_model): vocab over tp, d_model over fs."""
  return P("tp", "fs")


def vector() -> P:
  """Biases, norm scales and other vectors: replicated."""
  return P()


def stacked(spec: P, n_leading: int = 1) -> P:
  """Prepends leading stacked axes to `spec`: the first on pp, the rest unsharded.

  ``stacked(column_parallel(), 2) == P('pp', None, 'fs', 'tp')`` for a
  (stage, layer, fan_in, fan_out) kernel.
  """
  if n_leading < 1:
    raise ValueError(f"stacked: n_leading must be >= 1, got {n_leading}")
  return P("pp", *([None] * (n_leading - 1)), *spec)


def _mesh_sizes(mesh: jax.sharding.Mesh | Mapping[str, int]) -> Mapping[str, int]:
  return mesh.shape if isinstance(mesh, jax.sharding.Mesh) else mesh


def check_divisible(shape: Sequence[int], spec: P,
                    mesh: jax.sharding.Mesh | Mapping[str, int],
                    name: str = "parameter") -> None:
  """Checks that each dimension of `shape` divides by the mesh axes `spec` puts on it.

  Args:
    shape: the global shape of the array.
    spec: its PartitionSpec; entries past its length are unsharded.
    mesh: a Mesh, or a mapping axis -> size.
    name: what to call the array in the error.

  Raises:
    ValueError: one line naming the array, the dimension, its size and the
      axes whose product does not divide it; also when `spec` has more entries
      than `shape` has dimensions or names an axis the mesh lacks.
  """
  sizes = _mesh_sizes(mesh)
  shape = tuple(shape)
  if len(spec) > len(shape):
    raise ValueError(
        f"{name}: PartitionSpec {spec} has {len(spec)} entries but the shape {shape}"
        f" has {len(shape)} dimensions; give one entry per dimension")
  for dim, entry in enumerate(spec):
    axes = axis_names(entry)
    if not axes:
      continue
    for axis in axes:
      if axis not in sizes:
        raise ValueError(
            f"{name}: PartitionSpec {spec} names axis {axis!r} that the mesh lacks;"
            f" use axes of {tuple(sizes)}")
    product = math.prod(sizes[a] for a in axes)
    if shape[dim] % product:
      raise ValueError(
          f"{name}: dimension {dim} of size {shape[dim]} (shape {shape}) is not divisible"
          f" by mesh axes {axes} of total size {product}; change the mesh or the model"
          f" size so that {product} divides it")


def tree_check_divisible(params: Any, specs: Any,
                         mesh: jax.sharding.Mesh | Mapping[str, int]) -> None:
  """check_divisible for every leaf of `params`, naming each leaf by its tree path.

  Args:
    params: a pytree of arrays or anything with ``.shape`` (ShapeDtypeStruct).
    specs: a pytree of PartitionSpecs (None = replicated) with the structure
      of `params`.
    mesh: a Mesh, or a mapping axis -> size.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  spec_leaves = treedef.flatten_up_to(specs)
  for (path, leaf), spec in zip(leaves, spec_leaves):
    check_divisible(leaf.shape, P() if spec is None else spec, mesh,
                    name=jax.tree_util.keystr(path))
