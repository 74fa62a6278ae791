"""Dion (Distributed Orthonormalized Updates) for JAX and optax."""

from dion_jax.core import (
    Collectives,
    DionHyperParams,
    ScaleByDionState,
    dion_matrix_step,
    leaf_frames,
    scale_by_dion,
)
from dion_jax.frame import SCALE_RULES, DionDimensionNumbers, MatrixFrame, dion_rank, matrix_frame
from dion_jax.optimizer import LABELS, STATIC_ARGS, default_labels, dion
from dion_jax.orthogonalize import orthonormalize

__all__ = [
    "Collectives",
    "DionDimensionNumbers",
    "DionHyperParams",
    "LABELS",
    "MatrixFrame",
    "SCALE_RULES",
    "STATIC_ARGS",
    "ScaleByDionState",
    "default_labels",
    "dion",
    "dion_matrix_step",
    "dion_rank",
    "leaf_frames",
    "matrix_frame",
    "orthonormalize",
    "scale_by_dion",
]
