"""A command's process before JAX starts: OpenBLAS's threads, XLA's flags (host devices for a
CPU mesh, the GPU's overlap of collectives) and the multi-host runtime.

Import it before jax: the thread count must be in the environment before jaxlib loads
scipy's OpenBLAS.
"""
from __future__ import annotations

import math
import os

from train.run import agent
from train.run.config import Config

# jaxlib's CPU LAPACK calls scipy's OpenBLAS, whose threads compete with XLA's pool:
# one thread made Dion's CPU step 1.56x faster. A value the user set wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA's GPU counterparts of Megatron's --overlap-grad-reduce / --overlap-param-gather: the
# latency-hiding scheduler moves collectives to run beside compute, and the pipelined
# all-gather / reduce-scatter / all-reduce let the layer scan fetch the next layer's fs
# shards and reduce the last layer's gradients while the current layer computes; the
# combine thresholds batch the per-layer collectives into fewer, larger ones. Only the
# GPU backend reads them (jaxlib's CPU build knows the names, so CPU runs accept them);
# a value the user put in XLA_FLAGS wins.
GPU_OVERLAP_FLAGS = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
    "--xla_gpu_enable_pipelined_all_gather": "true",
    "--xla_gpu_enable_pipelined_reduce_scatter": "true",
    "--xla_gpu_enable_pipelined_all_reduce": "true",
    "--xla_gpu_enable_while_loop_double_buffering": "true",
    "--xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "--xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    "--xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
}


def _add_xla_flags(flags: dict[str, str]) -> None:
  current = os.environ.get("XLA_FLAGS", "")
  added = [f"{name}={value}" for name, value in flags.items() if name not in current]
  os.environ["XLA_FLAGS"] = " ".join([current] + added).strip()


def start_jax(cfg: Config) -> None:
  """XLA's flags (host devices for the mesh, GPU overlap, nested shard_maps) and the
  multi-host runtime, before JAX's backends start."""
  import jax

  import dion_jax

  processes = cfg.num_processes or 1
  _add_xla_flags({**GPU_OVERLAP_FLAGS, **dion_jax.parallel.NESTED_SHARD_MAP_XLA_FLAGS})
  if cfg.mesh is not None:
    needed = math.prod(dion_jax.parse_mesh_spec(cfg.mesh).values())
    if needed > processes and needed % processes == 0:
      # Only the CPU backend reads it: on CPU the mesh then fits; elsewhere it is inert.
      _add_xla_flags({_DEVICE_COUNT_FLAG: str(needed // processes)})
  if cfg.coordinator is not None or cfg.distributed:
    from train.run import peers

    agent.report_signals()  # under an agent (train/run/agent.py): it learns which signals came here
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    peers.join(cfg)


