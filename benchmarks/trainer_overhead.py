"""The trainer's overhead: ms per iteration of ``python -m train.gpt`` against its bare step.

    python benchmarks/trainer_overhead.py [--steps 60] [trainer flags, e.g. --preset tiny]

Sets up one run as the trainer does (``train.loop.setup``), then times
1. the bare jitted train step (forward, backward, optimizer) on one fixed batch already on
   the devices, ``--steps`` calls with one wait at the end;
2. the trainer's loop (``train.loop.train``: data loading, host-to-device transfer, metric
   reads, logging, the final checkpoint) for the same steps, from its metrics.jsonl:
   the median of ``ms_per_step`` over log intervals after the first (which holds the
   compile).
The difference over the bare step is the overhead (the issue's bound: under 5%).
"""
import json
import os
import statistics
import sys
import tempfile
import time

from train import config as config_lib
from train import gpt


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  run_dir = tempfile.mkdtemp(prefix="trainer_overhead_")
  cfg = config_lib.parse(["--steps", "60", "--log-interval", "10", "--eval-every", "0",
                          "--save-every", "0", *argv, "--run-dir", run_dir])
  gpt._start_jax(cfg)  # host devices for the mesh, before JAX starts
  import jax

  from train import loop

  run = loop.setup(cfg)
  batch = loop._global_batch(run, next(run.train_batches))
  state = jax.tree.map(lambda x: x.copy(), run.state)  # the step donates its input
  with jax.set_mesh(run.mesh):
    state, metrics = run.train_step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(cfg.steps):
      state, metrics = run.train_step(state, batch)
    jax.block_until_ready((state, metrics))
  bare_ms = (time.perf_counter() - start) / cfg.steps * 1e3

  loop.train(run)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  per_iteration = [r["ms_per_step"] for r in records if "ms_per_step" in r][1:]
  trainer_ms = statistics.median(per_iteration)
  print(f"bare step {bare_ms:.1f} ms, trainer {trainer_ms:.1f} ms per iteration"
        f" (median of {len(per_iteration)} intervals): overhead {trainer_ms / bare_ms - 1:+.1%}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
