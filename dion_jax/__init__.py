"""Dion (Distributed Orthonormalized Updates) and its family for JAX and optax.

    tx = dion_jax.dion(learning_rate=0.01, rank_fraction=0.25)   # an optax transformation

The package in layers (imports point down only):

- ``dion_jax.optimizers``: Dion, Muon, NorMuon, Dion2, NorDion2 on one skeleton, routed by labels.
- ``dion_jax.linalg``: orthonormal factors: ``orthonormalize`` (QR family) and
  ``polar_factor`` (Polar Express / Newton–Schulz).
- ``dion_jax.kernels``: Pallas GPU kernels beside their XLA compositions, loaded
  only when a GPU path asks for them.
- ``dion_jax.parallel``: the (rp, fs, ep, cp, tp, pp) mesh, layouts and collectives.
- ``dion_jax.accounting``: collective bytes of compiled programs (imported by no layer).

Importing the package changes nothing in the process: on CPU, set
``OPENBLAS_NUM_THREADS=1`` yourself before starting Python (README).
"""

from dion_jax.accounting import CollectiveStat, bytes_by_axes, collective_stats, format_table
from dion_jax.linalg import orthonormalize
from dion_jax.optimizers import (
    DION2_STATIC_ARGS,
    LABELS,
    MUON_STATIC_ARGS,
    NORDION2_STATIC_ARGS,
    NORMUON_STATIC_ARGS,
    SCALE_RULE_ALIASES,
    SCALE_RULES,
    STATIC_ARGS,
    Collectives,
    DionDimensionNumbers,
    DionHyperParams,
    MatrixFrame,
    ScaleByDionState,
    ScaleByOrthogonalState,
    add_decayed_weights,
    default_labels,
    dion,
    dion2,
    dion3,
    dion_matrix_step,
    dion_rank,
    leaf_frames,
    matrix_frame,
    matrix_optimizer,
    muon,
    nordion2,
    normuon,
    scale_by_dion,
    scale_by_orthogonal,
)
from dion_jax.parallel import (
    AXES,
    average_replicas,
    check_divisible,
    column_parallel,
    embedding,
    make_mesh,
    parse_mesh_spec,
    partition_specs_of,
    row_parallel,
    stacked,
    tree_check_divisible,
    value_and_grad_per_replica,
    vector,
)

__all__ = [
    "AXES",
    "CollectiveStat",
    "Collectives",
    "DION2_STATIC_ARGS",
    "DionDimensionNumbers",
    "DionHyperParams",
    "LABELS",
    "MUON_STATIC_ARGS",
    "MatrixFrame",
    "NORDION2_STATIC_ARGS",
    "NORMUON_STATIC_ARGS",
    "SCALE_RULES",
    "SCALE_RULE_ALIASES",
    "STATIC_ARGS",
    "ScaleByDionState",
    "ScaleByOrthogonalState",
    "add_decayed_weights",
    "average_replicas",
    "bytes_by_axes",
    "check_divisible",
    "collective_stats",
    "column_parallel",
    "default_labels",
    "dion",
    "dion2",
    "dion3",
    "dion_matrix_step",
    "dion_rank",
    "embedding",
    "format_table",
    "leaf_frames",
    "make_mesh",
    "matrix_frame",
    "matrix_optimizer",
    "muon",
    "nordion2",
    "normuon",
    "orthonormalize",
    "parse_mesh_spec",
    "partition_specs_of",
    "row_parallel",
    "scale_by_dion",
    "scale_by_orthogonal",
    "stacked",
    "tree_check_divisible",
    "value_and_grad_per_replica",
    "vector",
]
