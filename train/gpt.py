"""Train a GPT: ``python -m train.gpt [--mesh rp=1,fs=2,tp=2] [--preset tiny] ...``.

With no arguments it trains the ``tiny`` preset with Dion on the embedded corpus on
every device there is, and writes ``config.json``, ``metrics.jsonl`` and checkpoints
under ``runs/tiny-dion/``. ``--help`` lists the flags (``train/flags.py``); ``--config
run.yaml`` reads them from a file and ``--print-config`` prints them as one
(``train/config_file.py``).

One step, top to bottom: this loop feeds a global batch to ``train/step.py``, whose
jitted step takes the model's loss and gradients (``models/gpt.py``, per rp replica
through ``dion_jax.parallel.synced_over_replicas``, averaged over rp once per step), clips, and
applies Dion (``dion_jax/optimizers/dion.py`` on ``optimizers/skeleton.py``;
``dion_jax/parallel/``: the collectives).

Bad input (flags, mesh, batch, data, checkpoints, an unusable or busy run directory)
ends the run before anything is written, with one ``error: ...`` line on stderr. Exit
codes: 0 done; 1 a checkpoint failed to save (the previous one intact), out of memory, or
a process of a multi-host run lost (``train/peers.py``); 2 bad input; 3 diverged
(non-finite or spiking steps); 130 / 143 stopped by SIGINT / SIGTERM after saving.
"""
from __future__ import annotations

import math
import os
import sys

import numpy  # noqa: F401  numpy's own OpenBLAS loads first, keeping its threads

from train import cli
from train import config as config_lib
from train import config_file
from train.config import Config

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
    from train import peers

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    peers.join(cfg)


def _setup(argv: list[str] | None):
  """The run of ``argv``; bad input raises here, before anything is written. None after
  ``--print-config``, which prints the resolved flags instead."""
  cfg, print_config = config_lib.command(argv)
  cfg.check()
  if print_config:
    print(config_file.to_yaml(cfg.to_json()), end="")
    return None
  start_jax(cfg)
  from train import loop, peers  # import jax, models, dion_jax, data

  peers.watch(cfg)  # several processes: a fault in one, or a lost one, ends them all
  with peers.together(setting_up=True):
    return loop.setup(cfg)


def _train(run) -> int:
  if run is None:
    return 0
  from train import loop

  return loop.train(run)


def main(argv: list[str] | None = None) -> int:
  try:
    return cli.run(lambda: _setup(argv), _train)
  except KeyboardInterrupt:  # before training: the set-up writes nothing until its end
    print("error: interrupted before training started; nothing was saved", file=sys.stderr)
    return 128 + 2


if __name__ == "__main__":
  sys.exit(main())
