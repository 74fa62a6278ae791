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
"""

import dataclasses
import math
from typing import Callable, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec

TENSOR_PARALLEL_AXIS = "tp"

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


def _spec_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


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
    spec = PartitionSpec(*(tuple(spec) + (None,) * (ndim - len(spec))))
  fan_in, fan_out = shape[reduction], shape[output]
  tp_in = spec is not None and TENSOR_PARALLEL_AXIS in _spec_axes(spec[reduction])
  tp_out = spec is not None and TENSOR_PARALLEL_AXIS in _spec_axes(spec[output])
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
