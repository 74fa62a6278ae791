"""Communication and memory accounting from compiled programs.

- ``hlo``: the bytes of every collective of a compiled program, by mesh axes.
- ``update``: one optimizer update's collectives and state bytes on a mesh.
- ``jaxpr``: what a traced program runs per run: its primitives and matmul flops.

No other module of ``dion_jax`` imports this package (the package facade re-exports
four of its names); ``python -m benchmarks.comm_report`` uses it on the repository's GPT.
"""
from dion_jax.accounting.hlo import CollectiveStat, bytes_by_axes, collective_stats, format_table, shape_bytes
from dion_jax.accounting.jaxpr import matmul_flops, primitive_counts
from dion_jax.accounting.update import (
    abstract_params,
    abstract_state,
    full_gradient_bytes,
    ring_allreduce_bytes,
    state_bytes,
    update_stats,
)

__all__ = [
    "CollectiveStat",
    "abstract_params",
    "abstract_state",
    "bytes_by_axes",
    "collective_stats",
    "format_table",
    "full_gradient_bytes",
    "matmul_flops",
    "primitive_counts",
    "ring_allreduce_bytes",
    "shape_bytes",
    "state_bytes",
    "update_stats",
]
