"""The mesh (rp, fs, ep, cp, tp, pp), parameter layouts, and the collectives the optimizers use.

- ``mesh``: axis names, mesh specs, standard PartitionSpecs, divisibility checks.
- ``collectives``: reductions over named axes that vanish without axes.
- ``layout``: one parameter's optimizer state and step placed like the parameter.
- ``replicas``: per-replica gradients for Dion's compressed data-parallel sync.
- ``megabatch``: whole matrices from sharded blocks by two all-to-alls.

``models/`` uses this package (axis names and PartitionSpecs) and nothing else of
``dion_jax``.
"""
from dion_jax.parallel.layout import Layout, Placement
from dion_jax.parallel.mesh import (
    AXES,
    NESTED_SHARD_MAP_XLA_FLAGS,
    REPLICA_AXIS,
    TENSOR_PARALLEL_AXIS,
    axis_names,
    check_divisible,
    column_parallel,
    embedding,
    format_mesh_spec,
    make_mesh,
    padded_spec,
    parse_mesh_spec,
    partition_specs_of,
    row_parallel,
    stacked,
    tree_check_divisible,
    vector,
)
from dion_jax.parallel.replicas import (
    average_replicas,
    replica_spec,
    synced_over_replicas,
    value_and_grad_per_replica,
)

__all__ = [
    "AXES",
    "Layout",
    "NESTED_SHARD_MAP_XLA_FLAGS",
    "Placement",
    "REPLICA_AXIS",
    "TENSOR_PARALLEL_AXIS",
    "average_replicas",
    "axis_names",
    "check_divisible",
    "column_parallel",
    "embedding",
    "format_mesh_spec",
    "make_mesh",
    "padded_spec",
    "parse_mesh_spec",
    "partition_specs_of",
    "replica_spec",
    "row_parallel",
    "stacked",
    "synced_over_replicas",
    "tree_check_divisible",
    "value_and_grad_per_replica",
    "vector",
]
