"""The trainer's overhead: ms per iteration of ``python -m train.gpt`` against its bare step.

    python -m benchmarks.trainer_overhead [--steps 60] [trainer flags, e.g. --preset tiny]

Sets up one run as the trainer does (``train.run.setup.setup``), then times
1. the bare jitted train step (forward, backward, optimizer) on one fixed batch already on
   the devices, ``--steps`` calls with one wait at the end (``timing.throughput_time``);
2. the trainer's loop (``train.run.loop.train``: data loading, host-to-device transfer, metric
   reads, logging, the final checkpoint) for the same steps, from its metrics.jsonl:
   the median of ``ms_per_step`` over log intervals after the first (which holds the
   compile).
The difference over the bare step is the overhead (the issue's bound: under 5%).
"""
import statistics
import sys
import tempfile

from train.gpu import timing
from train.run import config as config_lib
from train.run import start
from train.store import log


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  run_dir = tempfile.mkdtemp(prefix="trainer_overhead_")
  cfg = config_lib.parse(["--steps", "60", "--log-interval", "10", "--eval-every", "0",
                          "--save-every", "0", *argv, "--run-dir", run_dir])
  start.start_jax(cfg)  # host devices for the mesh, before JAX starts
  import jax

  from train.run import loop, setup

  run = setup.setup(cfg)
  batch = loop.global_batch(run, next(run.data.loader))
  state = jax.tree.map(lambda x: x.copy(), run.state)  # the step donates its input

  def step(state, _metrics):  # returns the next call's arguments: the new state, its metrics
    return run.train_step(state, batch)

  with jax.set_mesh(run.mesh):
    bare_ms = timing.throughput_time(step, (state, None), cfg.steps) * 1e3

  loop.train(run)
  train, _ = log.read_metrics(run_dir)
  per_iteration = [r["ms_per_step"] for r in train.values()][1:]
  trainer_ms = statistics.median(per_iteration)
  print(f"bare step {bare_ms:.1f} ms, trainer {trainer_ms:.1f} ms per iteration"
        f" (median of {len(per_iteration)} intervals): overhead {trainer_ms / bare_ms - 1:+.1%}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
