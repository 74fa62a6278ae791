"""Dion's view of a parameter as a batch of matrices: rank, working frame, scale rules."""

import math

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dion_jax.optimizers import frame
from dion_jax.optimizers.frame import DionDimensionNumbers

FLAX = DionDimensionNumbers()  # (..., fan_in, fan_out)


@pytest.mark.parametrize(
    "fraction, multiple, m, n, want",
    [
        (1.0, 1, 40, 24, 24),
        (0.25, 1, 40, 24, 6),
        (0.25, 1, 24, 40, 6),  # min(m, n) either way round
        (1 / 16, 1, 512, 512, 32),
        (0.3, 8, 100, 50, 16),  # ceil(15 / 8) * 8
        (1.0, 8, 30, 20, 20),  # rounded up to 24, clipped to min(m, n)
        (1e-3, 1, 64, 10, 1),  # never zero
        (0.5, 128, 4096, 1024, 512),
    ],
)
def test_rank_rule(fraction, multiple, m, n, want):
  assert frame.dion_rank(fraction, multiple, m, n) == want


def test_tall_kernel_rows_are_fan_out():
  fr = frame.matrix_frame((24, 40), FLAX, 0.5, 1)
  assert (fr.fan_in, fr.fan_out, fr.rank) == (24, 40, 12)
  assert (fr.row_axis, fr.col_axis, fr.batch_axes) == (1, 0, ())
  assert not fr.transposed and fr.q_shape == (24, 12)  # Q is (fan_in, r), as the reference


def test_wide_kernel_is_transposed():
  fr = frame.matrix_frame((40, 24), FLAX, 0.5, 1)  # fan_in 40 > fan_out 24
  assert (fr.row_axis, fr.col_axis) == (0, 1)
  assert fr.transposed and fr.q_shape == (24, 12)  # Q is (fan_out, r)


def test_square_tie_goes_to_fan_out():
  fr = frame.matrix_frame((32, 32), FLAX, 1.0, 1)
  assert fr.row_axis == 1 and not fr.transposed


@pytest.mark.parametrize(
    "shape, spec, row_axis",
    [
        ((24, 40), P(None, "tp"), 1),  # column-parallel: tp on fan_out, also the longer
        ((40, 24), P("tp", None), 0),  # row-parallel: tp on fan_in, also the longer
        ((24, 40), P("tp", None), 0),  # tp decides even against the longer dimension
        ((40, 24), P("fs", "tp"), 1),
        ((32, 32), P("tp", "fs"), 0),  # and on a tie
        ((24, 40), P(("fs", "tp"), None), 0),  # tp inside a tuple entry
        ((24, 40), P("fs", None), 1),  # no tp: the longer one
        ((40, 24), P("tp", "tp"), 0),  # tp on both (impossible in practice): the longer
        ((3, 24, 40), P("pp", "tp"), 1),  # short spec, padded with None
        ((3, 24, 40), P("pp", "tp", None), 1),
    ],
)
def test_tensor_parallel_axis_decides_rows(shape, spec, row_axis):
  fr = frame.matrix_frame(shape, FLAX, 0.5, 1, spec=spec)
  assert fr.row_axis == row_axis % len(shape)
  assert fr.transposed == (fr.row_axis == len(shape) - 2)
  assert len(fr.spec) == len(shape)


def test_frame_does_not_depend_on_other_axis_names():
  """Only which dimension carries "tp" matters, not data-parallel axes or their sizes."""
  base = frame.matrix_frame((24, 40), FLAX, 0.25, 1, spec=P("tp", None))
  for spec in (P("tp", "fs"), P(("tp",), ("fs", "rp")), P("tp")):
    fr = frame.matrix_frame((24, 40), FLAX, 0.25, 1, spec=spec)
    assert (fr.row_axis, fr.col_axis, fr.rank, fr.transposed) == (
        base.row_axis, base.col_axis, base.rank, base.transposed,
    )  # fmt: skip


def test_batch_axes_of_stacked_parameters():
  fr = frame.matrix_frame((2, 3, 24, 40), FLAX, 0.5, 1)
  assert fr.batch_axes == (0, 1) and fr.batch_shape == (2, 3)
  assert fr.q_shape == (2, 3, 24, 12)


def test_declared_dimension_numbers():
  # (fan_in, experts, fan_out): a batch axis in the middle.
  fr = frame.matrix_frame((24, 5, 40), DionDimensionNumbers(reduction_axis=0, output_axis=2), 0.5, 1)
  assert (fr.fan_in, fr.fan_out, fr.batch_axes) == (24, 40, (1,))
  assert fr.row_axis == 2 and fr.q_shape == (5, 24, 12)
  # PyTorch layout (fan_out, fan_in).
  fr = frame.matrix_frame((40, 24), DionDimensionNumbers(reduction_axis=1, output_axis=0), 0.5, 1)
  assert (fr.fan_in, fr.fan_out, fr.row_axis, fr.transposed) == (24, 40, 0, False)


@pytest.mark.parametrize(
    "shape, dims",
    [((24, 40), FLAX), ((40, 24), FLAX), ((2, 24, 40), FLAX), ((24, 5, 40), DionDimensionNumbers(0, 2))],
)
def test_batch_first_round_trip(shape, dims):
  fr = frame.matrix_frame(shape, dims, 1.0, 1)
  x = np.arange(np.prod(shape)).reshape(shape)
  y = fr.to_batch_first(x)
  np.testing.assert_array_equal(fr.from_batch_first(y), x)
  B = np.swapaxes(y, -1, -2) if fr.rows_last else y
  assert B.shape == fr.batch_shape + (fr.rows, fr.cols)
  # B is the reference's (fan_out, fan_in) matrix, or its transpose when transposed.
  idx = (0,) * len(fr.batch_axes)
  X_ref = np.moveaxis(x, (dims.output_axis, dims.reduction_axis), (0, 1))[(slice(None), slice(None)) + idx]
  np.testing.assert_array_equal(B[idx], X_ref.T if fr.transposed else X_ref)


@pytest.mark.parametrize(
    "shape, dims, word",
    [
        ((8,), FLAX, "shape \\(8,\\)"),
        ((), FLAX, "matrix"),
        ((4, 8), DionDimensionNumbers(0, 2), "name axes"),
        ((4, 8), DionDimensionNumbers(0, -2), "both"),
    ],
)
def test_not_a_matrix(shape, dims, word):
  with pytest.raises(ValueError, match=word):
    frame.matrix_frame(shape, dims, 1.0, 1, name="parameter ['w']")


@pytest.mark.parametrize(
    "rule, fan_out, fan_in, want",
    [
        ("fan_ratio", 40, 24, math.sqrt(40 / 24)),
        ("fan_ratio", 24, 40, math.sqrt(24 / 40)),
        ("spectral", 40, 24, 0.2 * math.sqrt(40)),
        ("spectral", 24, 40, 0.2 * math.sqrt(40)),
        ("max_one", 40, 24, math.sqrt(40 / 24)),
        ("max_one", 24, 40, 1.0),
        ("none", 40, 24, 1.0),
    ],
)
def test_scale_rules(rule, fan_out, fan_in, want):
  assert frame.SCALE_RULES[rule](fan_out, fan_in) == pytest.approx(want, rel=1e-12)
