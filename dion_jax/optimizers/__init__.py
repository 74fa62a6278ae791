"""The optimizers: Dion, Muon, NorMuon, Dion2 and NorDion2, each a thin definition on one skeleton.

- ``frame``: how a parameter is seen as a batch of matrices (axes, rank, heads, scale rules).
- ``skeleton``: the one init/update of every matrix optimizer, on one device or a mesh.
- ``routing``: labels, weight decay and the scalar optimizers around a matrix optimizer.
- ``dion_math`` / ``dion``: Dion's matrix step, and Dion on the skeleton.
- ``orthogonal_math`` / ``orthogonal``: Muon's, NorMuon's, Dion2's and NorDion2's matrix
  steps, and ``scale_by_orthogonal`` on the skeleton; ``muon``, ``dion2``: their optimizers.
"""
from dion_jax.optimizers.dion import STATIC_ARGS, ScaleByDionState, dion, leaf_frames, scale_by_dion
from dion_jax.optimizers.dion2 import DION2_STATIC_ARGS, NORDION2_STATIC_ARGS, dion2, dion3, nordion2
from dion_jax.optimizers.dion_math import Collectives, DionHyperParams, dion_matrix_step
from dion_jax.optimizers.frame import (
    SCALE_RULE_ALIASES,
    SCALE_RULES,
    DionDimensionNumbers,
    MatrixFrame,
    MatrixView,
    dion_rank,
    matrix_frame,
    scale_rule_fn,
)
from dion_jax.optimizers.muon import MUON_STATIC_ARGS, NORMUON_STATIC_ARGS, muon, normuon
from dion_jax.optimizers.orthogonal import ScaleByOrthogonalState, scale_by_orthogonal
from dion_jax.optimizers.routing import LABELS, add_decayed_weights, default_labels, matrix_optimizer
from dion_jax.optimizers.skeleton import MatrixRule, scale_by_matrix_rule

__all__ = [
    "Collectives",
    "DION2_STATIC_ARGS",
    "DionDimensionNumbers",
    "DionHyperParams",
    "LABELS",
    "MUON_STATIC_ARGS",
    "MatrixFrame",
    "MatrixRule",
    "MatrixView",
    "NORDION2_STATIC_ARGS",
    "NORMUON_STATIC_ARGS",
    "SCALE_RULES",
    "SCALE_RULE_ALIASES",
    "STATIC_ARGS",
    "ScaleByDionState",
    "ScaleByOrthogonalState",
    "add_decayed_weights",
    "default_labels",
    "dion",
    "dion2",
    "dion3",
    "dion_matrix_step",
    "dion_rank",
    "leaf_frames",
    "matrix_frame",
    "matrix_optimizer",
    "muon",
    "nordion2",
    "normuon",
    "scale_by_dion",
    "scale_by_matrix_rule",
    "scale_by_orthogonal",
    "scale_rule_fn",
]
