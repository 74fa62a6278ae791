"""The chunked LM head and loss (``--loss-chunk``): the trainer's step's memory and time.

    python -m benchmarks.loss_chunk --stage memory                 # small, fs=8, compile only
    python -m benchmarks.loss_chunk --stage memory --loss-only --layers 1 --mesh fs=1 --batch 1
    python -m benchmarks.loss_chunk --stage time --layers 2        # small's width, 2 layers

Stages (fake CPU devices):

- ``memory``: the trainer's compiled step (``train.run.trainer.make_trainer``: the
  optimizer's update included) of ``--preset`` on ``--mesh`` at each ``--chunks`` value,
  compiled from abstract arrays: ``memory_analysis()``'s temporaries, and the same model
  with a 256-token vocabulary (what the vocabulary costs), in MiB per device. With
  ``--loss-only``, the loss's value and gradient alone (``models.loss``), no optimizer.
- ``time``: the step's wall time at each ``--chunks`` value, the values interleaved round
  after round (the machine may be shared), medians; and the loss and gradient of each
  against the unchunked step's (largest relative difference over the parameters).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from benchmarks import harness

MiB = 2**20


def _trainer(preset: str, mesh_spec: str, batch: int, chunk: int, **overrides):
  import jax
  import models
  from tests import model_meshes
  from train.run import trainer
  from train.run.config import Config

  cfg = Config(preset=preset, mesh=mesh_spec, global_batch_size=batch, loss_chunk=chunk)
  model_cfg = models.preset(preset, loss_chunk=chunk, **overrides)
  mesh = model_meshes.mesh(mesh_spec)
  par, accum = trainer.parallelism(cfg, mesh)
  graphdef, params = models.abstract(model_cfg, par)
  made = {}

  def state_of(params):
    made["state"], made["step"] = trainer.make_trainer(cfg, model_cfg, graphdef, params, par, accum)
    return made["state"]

  with jax.set_mesh(mesh):
    state = jax.eval_shape(state_of, params)
  return mesh, graphdef, par, state, made["step"], model_cfg


def memory(args) -> None:
  import jax
  import jax.numpy as jnp
  import models

  print("| vocabulary | loss_chunk | temporaries MiB | arguments MiB | outputs MiB |")
  print("| --- | --- | --- | --- | --- |")
  for vocab, chunks in ((None, args.chunks), (256, [0])):
    for chunk in chunks:
      overrides = dict(num_layers=args.layers) if args.layers else {}
      if vocab:
        overrides["vocab_size"] = vocab
      mesh, graphdef, par, state, step, model_cfg = _trainer(args.preset, args.mesh, args.batch, chunk, **overrides)
      batch = {k: jax.ShapeDtypeStruct((args.batch, model_cfg.seq_len), jnp.int32,
                                       sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("rp", "fs", "ep"))))
               for k in ("inputs", "targets")}
      if args.loss_only:
        step = jax.jit(jax.value_and_grad(lambda p, b, g=graphdef: models.loss(g, p, b, par)))
        state = state.params
      with jax.set_mesh(mesh):
        mem = step.lower(state, batch).compile().memory_analysis()
      print(f"| {model_cfg.padded_vocab} | {chunk} | {mem.temp_size_in_bytes / MiB:.1f} |"
            f" {mem.argument_size_in_bytes / MiB:.1f} | {mem.output_size_in_bytes / MiB:.1f} |", flush=True)


def speed(args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import models
  from tests import model_meshes

  overrides = dict(num_layers=args.layers) if args.layers else {}
  cfg = models.preset(args.preset, **overrides)
  mesh = model_meshes.mesh(args.mesh)
  par = models.Parallelism(mesh)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  with jax.set_mesh(mesh):
    _, params = models.init(cfg, par)
    steps = {}
    for chunk in args.chunks:
      graphdef, _ = models.abstract(dataclasses.replace(cfg, loss_chunk=chunk), par)
      steps[chunk] = jax.jit(jax.value_and_grad(lambda p, b, g=graphdef: models.loss(g, p, b, par)))
    results = {c: jax.block_until_ready(step(params, batch)) for c, step in steps.items()}
    times = {c: [] for c in steps}
    for _ in range(args.rounds):
      for chunk, step in steps.items():
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, batch))
        times[chunk].append(time.perf_counter() - t0)
  want_loss, want_grads = results[args.chunks[0]]
  print(f"| loss_chunk | median s ({args.rounds} rounds) | / loss_chunk={args.chunks[0]} | loss rel. diff | max grad rel. diff |")
  print("| --- | --- | --- | --- | --- |")
  base = statistics.median(times[args.chunks[0]])
  for chunk in steps:
    loss, grads = results[chunk]
    diff = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
               for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    t = statistics.median(times[chunk])
    print(f"| {chunk} | {t:.3f} | {t / base:.3f} | {abs(float(loss) / float(want_loss) - 1):.1e} | {diff:.1e} |")


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_chunk", description=__doc__.split("\n")[0])
  parser.add_argument("--stage", choices=("memory", "time"), required=True)
  parser.add_argument("--preset", default="small")
  parser.add_argument("--layers", type=int, default=None, help="override the preset's layers")
  parser.add_argument("--mesh", default="fs=8")
  parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
  parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 1024])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--loss-only", action="store_true", help="memory: the loss's gradient, not the trainer's step")
  args = parser.parse_args()
  harness.setup_process(8, "cpu")
  memory(args) if args.stage == "memory" else speed(args)


if __name__ == "__main__":
  main()
