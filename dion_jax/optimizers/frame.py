"""Which axes of a parameter Dion treats as a matrix, and in which orientation.

A Dion parameter has a fan_in (reduction) axis and a fan_out (output) axis; every
other axis is a batch axis (stacked layers, pipeline stages, experts), each slice an
independent matrix. Dion works on ``B`` with rows = one of the two matrix axes and
columns = the other; P (rows x r) is orthonormalized, Q (cols x r) is the state.

The row axis is decided from the parameter's *logical* layout, never from mesh axis
sizes, so one model runs the same algorithm on every mesh, one device included:
1. the matrix axis whose PartitionSpec entry names the tensor-parallel axis ``"tp"``;
2. otherwise the longer of the two; fan_out on a tie.
This agrees with the reference (rows = fan_out unless fan_out < fan_in) wherever the
reference does not depend on the parallel layout.

Muon and NorMuon can also orthogonalize per attention head: a :class:`MatrixView`
splits the fan_out axis of size H·d into (H, d), each head its own (d x fan_in)
matrix (the reference's ``num_heads``).
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from dion_jax.parallel.mesh import TENSOR_PARALLEL_AXIS, axis_names, padded_spec

# Update scale rules: (fan_out, fan_in) -> multiplier of the orthonormal update.
SCALE_RULES: dict[str, Callable[[int, int], float]] = {
    # The reference's sqrt(fan_out / fan_in).
    "fan_ratio": lambda fan_out, fan_in: math.sqrt(fan_out / fan_in),
    # Megatron-Dion's / Moonlight's spectral rule, matched to AdamW's update RMS.
    "spectral": lambda fan_out, fan_in: 0.2 * math.sqrt(max(fan_out, fan_in)),
    # Keller Jordan's Muon rule: only ever scales up.
    "max_one": lambda fan_out, fan_in: math.sqrt(max(1.0, fan_out / fan_in)),
    "none": lambda fan_out, fan_in: 1.0,
}
# microsoft/dion's adjust_lr names for the same rules (its None is "none").
SCALE_RULE_ALIASES = {"spectral_norm": "fan_ratio", "rms_norm": "spectral"}


def scale_rule_fn(scale_rule: str | Callable[[int, int], float] | None) -> Callable[[int, int], float]:
  """The rule ``(fan_out, fan_in) -> scale`` named by ``scale_rule`` (one of
  :data:`SCALE_RULES`, an alias from :data:`SCALE_RULE_ALIASES`, None for ``"none"``),
  or ``scale_rule`` itself when it is a callable."""
  if callable(scale_rule):
    return scale_rule
  name = "none" if scale_rule is None else SCALE_RULE_ALIASES.get(scale_rule, scale_rule)
  if name not in SCALE_RULES:
    accepted = tuple(SCALE_RULES) + tuple(SCALE_RULE_ALIASES)
    raise ValueError(f"scale_rule={scale_rule!r} is not supported; use one of {accepted}, None or a callable")
  return SCALE_RULES[name]


class DionDimensionNumbers(NamedTuple):
  """The fan_in (reduction) and fan_out (output) axes of a parameter.

  The default fits Flax ``Dense`` kernels, (..., fan_in, fan_out), with any number of
  leading batch axes. Like optax's ``MuonDimensionNumbers``.
  """

  reduction_axis: int = -2
  output_axis: int = -1


def dion_rank(rank_fraction: float, rank_multiple_of: int, m: int, n: int) -> int:
  """``ceil(rank_fraction·min(m, n) / multiple)·multiple``, clipped to ``min(m, n)``."""
  r = math.ceil(rank_fraction * min(m, n) / rank_multiple_of) * rank_multiple_of
  return min(r, m, n)


@dataclasses.dataclass(frozen=True)
class MatrixFrame:
  """Static description of one Dion parameter (a batch of matrices).

  Attributes:
    shape: the parameter's shape.
    row_axis, col_axis: parameter axes that are B's rows and columns.
    batch_axes: the remaining axes, in order.
    fan_out, fan_in: the matrix dimensions in the reference's (fan_out, fan_in) terms.
    rank: r.
    transposed: the reference's flag: rows = fan_in, so B = Mᵀ in its (fan_out, fan_in) frame.
    spec: the parameter's PartitionSpec (padded to its rank), or None.
    name: how errors name the parameter (its path).
  """

  shape: tuple[int, ...]
  row_axis: int
  col_axis: int
  batch_axes: tuple[int, ...]
  fan_out: int
  fan_in: int
  rank: int
  transposed: bool
  spec: PartitionSpec | None = None
  name: str = "parameter"

  @property
  def rows(self) -> int:
    return self.shape[self.row_axis]

  @property
  def cols(self) -> int:
    return self.shape[self.col_axis]

  @property
  def batch_shape(self) -> tuple[int, ...]:
    return tuple(self.shape[a] for a in self.batch_axes)

  @property
  def compressible(self) -> bool:
    """Whether P and R, (rows + cols)·r values, are fewer than the matrix's rows·cols: only
    then do replicas average them instead of the gradient (microsoft/dion's
    ``compressed_all_reduce``); never at full rank."""
    return (self.rows + self.cols) * self.rank < self.rows * self.cols

  @property
  def q_shape(self) -> tuple[int, ...]:
    """Q: (*batch, cols, r); cols = fan_in, or fan_out when transposed."""
    return self.batch_shape + (self.cols, self.rank)

  @property
  def rows_last(self) -> bool:
    """Whether the row axis comes after the column axis in the parameter's layout."""
    return self.row_axis > self.col_axis

  @property
  def _batch_first(self) -> tuple[int, ...]:
    return self.batch_axes + tuple(sorted((self.row_axis, self.col_axis)))

  def to_batch_first(self, x):
    """Parameter layout -> (*batch, a, b), the matrix axes in their own order: (rows,
    cols), or (cols, rows) when ``rows_last``. A no-op for stacked Flax kernels, so
    the matrix algebra reads M in place instead of transposing it."""
    return x.transpose(self._batch_first)

  def from_batch_first(self, x):
    """Inverse of :meth:`to_batch_first`."""
    return x.transpose(tuple(np.argsort(self._batch_first)))


def matrix_frame(
    shape: tuple[int, ...],
    dims: DionDimensionNumbers,
    rank_fraction: float,
    rank_multiple_of: int,
    spec: PartitionSpec | None = None,
    name: str = "parameter",
) -> MatrixFrame:
  """Builds the :class:`MatrixFrame` of a parameter; raises ValueError if it is no matrix."""
  ndim = len(shape)
  if ndim < 2:
    raise ValueError(
        f"{name} has shape {tuple(shape)}, but Dion needs a matrix (>= 2 dims); "
        "label it for the scalar optimizer ('adamw' or 'lion') instead"
    )
  if not all(-ndim <= a < ndim for a in dims):
    raise ValueError(f"{name} with shape {tuple(shape)}: DionDimensionNumbers {dims} name axes it lacks")
  reduction, output = (a % ndim for a in dims)
  if reduction == output:
    raise ValueError(f"{name}: reduction_axis and output_axis are both {reduction}")
  if spec is not None:
    spec = padded_spec(spec, ndim)
  fan_in, fan_out = shape[reduction], shape[output]
  tp_in = spec is not None and TENSOR_PARALLEL_AXIS in axis_names(spec[reduction])
  tp_out = spec is not None and TENSOR_PARALLEL_AXIS in axis_names(spec[output])
  if tp_in != tp_out:
    row_axis = reduction if tp_in else output
  else:
    row_axis = reduction if fan_in > fan_out else output
  col_axis = output if row_axis == reduction else reduction
  batch_axes = tuple(a for a in range(ndim) if a not in (reduction, output))
  rank = dion_rank(rank_fraction, rank_multiple_of, fan_out, fan_in)
  return MatrixFrame(
      tuple(shape), row_axis, col_axis, batch_axes, fan_out, fan_in, rank, row_axis == reduction, spec, name
  )


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """A parameter seen as a batch of matrices, after the optional split into heads.

  Attributes:
    frame: the :class:`MatrixFrame` of the (head-split) view.
    out_axis: the parameter's fan_out axis (split when heads > 1).
    in_axis: the view's fan_in axis.
    heads: how many heads the fan_out axis is split into (1: none).
  """

  frame: MatrixFrame
  out_axis: int
  in_axis: int
  heads: int = 1

  def split(self, x):
    """Splits the fan_out axis of a parameter, or of this device's block of it (whole heads)."""
    if self.heads == 1:
      return x
    o, head_dim = self.out_axis, self.frame.shape[self.out_axis + 1]
    return x.reshape(x.shape[:o] + (x.shape[o] // head_dim, head_dim) + x.shape[o + 1 :])

  def merge(self, x):
    if self.heads == 1:
      return x
    o = self.out_axis
    return x.reshape(x.shape[:o] + (x.shape[o] * x.shape[o + 1],) + x.shape[o + 2 :])

  def to_blocks(self, x):
    """(local) parameter layout -> (B, a, b), the matrix axes in their own order."""
    x = self.frame.to_batch_first(self.split(x))
    return x.reshape((-1,) + x.shape[-2:])

  def from_blocks(self, y, like_shape):
    batch = tuple(like_shape[a] for a in self.frame.batch_axes)
    return self.merge(self.frame.from_batch_first(y.reshape(batch + y.shape[1:])))

  @property
  def blocks_fan_in_axis(self) -> int:
    """The fan_in axis (1 or 2) of :meth:`to_blocks`' output."""
    return 1 if self.in_axis < self.out_axis + (self.heads > 1) else 2

  @property
  def param_fan_in_axis(self) -> int:
    """The fan_in axis in the parameter's own (un-split) layout."""
    return self.in_axis - (self.heads > 1 and self.in_axis > self.out_axis)

  def param_spec(self) -> PartitionSpec:
    """The parameter's (un-split) PartitionSpec, read back from the view's."""
    spec = tuple(self.frame.spec)
    if self.heads > 1:
      spec = spec[: self.out_axis + 1] + spec[self.out_axis + 2 :]
    return PartitionSpec(*spec)

  def unnamed(self) -> "MatrixView":
    """This view without the parameter's name: equal for parameters of one geometry."""
    return dataclasses.replace(self, frame=dataclasses.replace(self.frame, name=""))

  def stacked(self, n: int, name: str) -> "MatrixView":
    """The view of ``n`` parameters like this one stacked along a new leading (batch) axis."""
    fr = self.frame
    frame = dataclasses.replace(
        fr, shape=(n,) + fr.shape, row_axis=fr.row_axis + 1, col_axis=fr.col_axis + 1,
        batch_axes=(0,) + tuple(a + 1 for a in fr.batch_axes),
        spec=None if fr.spec is None else PartitionSpec(None, *fr.spec), name=name,
    )  # fmt: skip
    return dataclasses.replace(self, frame=frame, out_axis=self.out_axis + 1, in_axis=self.in_axis + 1)


def matrix_view(
    shape: tuple[int, ...],
    dims: DionDimensionNumbers,
    spec: PartitionSpec | None,
    name: str,
    heads: int | None = None,
    rank_fraction: float = 1.0,
    rank_multiple_of: int = 1,
) -> MatrixView:
  """The :class:`MatrixView` of a parameter, its fan_out axis split into ``heads``."""
  ndim = len(shape)
  red, out = (a % ndim for a in dims)
  heads = heads or 1
  if heads > 1:
    if shape[out] % heads:
      raise ValueError(f"num_heads={heads} must divide the fan_out axis ({shape[out]}) of {name}")
    shape = shape[:out] + (heads, shape[out] // heads) + shape[out + 1 :]
    if spec is not None:
      entries = tuple(padded_spec(spec, ndim))
      spec = PartitionSpec(*entries[:out], entries[out], None, *entries[out + 1 :])
    red = red + 1 if red > out else red
    dims = DionDimensionNumbers(red, out + 1)
  frame = matrix_frame(tuple(shape), dims, rank_fraction, rank_multiple_of, spec, name=name)
  return MatrixView(frame, out, red, heads)


def per_leaf(option: Any, params: Any, is_leaf: Callable[[Any], bool]) -> list:
  """A per-leaf option for every leaf of ``params``, in flatten order.

  ``option`` is None, one value (``is_leaf``), a pytree matched to ``params`` by path
  (so a tree masked by ``optax.partition`` works; missing paths give None), or a
  callable ``params -> such a tree``.
  """
  if callable(option):
    option = option(params)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if option is None or not isinstance(option, (dict, list, tuple)) or is_leaf(option):
    return [option] * len(leaves)
  by_path = {jax.tree_util.keystr(p): v
             for p, v in jax.tree_util.tree_flatten_with_path(option, is_leaf=is_leaf)[0]}
  return [by_path.get(jax.tree_util.keystr(p)) for p, _ in leaves]


def leaf_views(params: Any, *, dimension_numbers=None, partition_specs=None, num_heads=None,
               rank_fraction: float = 1.0, rank_multiple_of: int = 1) -> list[MatrixView]:
  """The :class:`MatrixView` of every leaf of ``params``, in flatten order; each option
  as :func:`per_leaf` takes it (default dimension numbers: Flax kernels)."""
  dims = per_leaf(dimension_numbers, params, lambda x: isinstance(x, DionDimensionNumbers))
  specs = per_leaf(partition_specs, params, lambda x: isinstance(x, PartitionSpec))
  heads = per_leaf(num_heads, params, lambda x: isinstance(x, int))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  return [
      matrix_view(tuple(x.shape), d or DionDimensionNumbers(), s, f"parameter {p or '<root>'}", h,
                  rank_fraction, rank_multiple_of)
      for x, d, s, h, p in zip(jax.tree.leaves(params), dims, specs, heads, paths)
  ]
