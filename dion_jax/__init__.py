"""Dion (Distributed Orthonormalized Updates) for JAX and optax."""

import os

import numpy as _np  # noqa: F401  numpy's own OpenBLAS starts first, with its default threads.

# jaxlib's CPU LAPACK kernels call scipy's OpenBLAS, which loads on the first LAPACK
# call. Its worker threads then compete with XLA's thread pool for the same cores:
# one OpenBLAS thread made Dion's CPU step 1.56x faster here (rank 1/4, 6 layers at
# d=512: 156.5 -> 100.5 ms, benchmarks/dion_step.py). A value the user set wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from dion_jax.core import Collectives, DionHyperParams, dion_matrix_step
from dion_jax.comms import CollectiveStat, bytes_by_axes, collective_stats, format_table
from dion_jax.frame import SCALE_RULE_ALIASES, SCALE_RULES, DionDimensionNumbers, MatrixFrame, dion_rank, matrix_frame
from dion_jax.mesh import (
    AXES,
    check_divisible,
    column_parallel,
    embedding,
    make_mesh,
    parse_mesh_spec,
    row_parallel,
    stacked,
    tree_check_divisible,
    vector,
)
from dion_jax.optimizer import LABELS, STATIC_ARGS, add_decayed_weights, default_labels, dion, matrix_optimizer
from dion_jax.family import ScaleByOrthogonalState, scale_by_orthogonal
from dion_jax.family_optimizer import DION2_STATIC_ARGS, MUON_STATIC_ARGS, NORMUON_STATIC_ARGS, dion2, muon, normuon
from dion_jax.orthogonalize import orthonormalize
from dion_jax.transform import ScaleByDionState, leaf_frames, scale_by_dion
from dion_jax.sharded import average_replicas, partition_specs_of, value_and_grad_per_replica

__all__ = [
    "DION2_STATIC_ARGS",
    "MUON_STATIC_ARGS",
    "NORMUON_STATIC_ARGS",
    "SCALE_RULE_ALIASES",
    "ScaleByOrthogonalState",
    "add_decayed_weights",
    "dion2",
    "matrix_optimizer",
    "muon",
    "normuon",
    "scale_by_orthogonal",
    "AXES",
    "CollectiveStat",
    "Collectives",
    "DionDimensionNumbers",
    "DionHyperParams",
    "LABELS",
    "MatrixFrame",
    "SCALE_RULES",
    "STATIC_ARGS",
    "ScaleByDionState",
    "average_replicas",
    "bytes_by_axes",
    "check_divisible",
    "collective_stats",
    "column_parallel",
    "default_labels",
    "dion",
    "dion_matrix_step",
    "dion_rank",
    "embedding",
    "format_table",
    "leaf_frames",
    "make_mesh",
    "matrix_frame",
    "orthonormalize",
    "parse_mesh_spec",
    "partition_specs_of",
    "row_parallel",
    "scale_by_dion",
    "stacked",
    "tree_check_divisible",
    "value_and_grad_per_replica",
    "vector",
]
