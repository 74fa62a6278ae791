"""The norm of Dion's per-replica gradients on a real run: each step's sketch estimate and
the replicas' rms against the exact norm of their mean, all three on the same gradients.

    python -m benchmarks.grad_norm_estimate --mesh rp=8 --clip-by sketch [--steps 300]

Sets up ``python -m train.gpt --preset tiny`` (global batch 16, Dion at its default rank)
on the mesh, then steps the trainer's pieces: the gradient (``train.run.step.make_gradient``),
the three norms of ``train/run/grad_norm.py`` on it, clipping at ``--clip-grad`` by the
``--clip-by`` norm, and Dion's update (no guard: no step of tiny is non-finite). Prints the
ratio of the sketch's and of the rms's norm to the exact one (median and worst over the
steps), the steps that each norm clips on this trajectory, and the final validation loss;
``--out FILE`` keeps every step's three norms as JSON.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

from train.run import config as config_lib
from train.run import start

NORMS = ("sketch", "rms", "exact")  # train.run.grad_norm.NORMS, before JAX starts


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_norm_estimate", description=" ".join(__doc__.split("\n\n")[0].split()))
  parser.add_argument("--mesh", default="rp=8")
  parser.add_argument("--clip-by", choices=NORMS, default="sketch")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--clip-grad", type=float, default=1.0)
  parser.add_argument("--out")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory(prefix="grad_norm_estimate_") as run_dir:
    cfg = config_lib.parse(["--preset", "tiny", "--mesh", args.mesh, "--steps", str(args.steps),
                            "--global-batch-size", "16", "--run-dir", run_dir, "--grad-norm", args.clip_by])
    start.start_jax(cfg)
    from train.run import setup  # imports jax
    run = setup.setup(cfg)
    norms, loss = _train(run, args.clip_by, args.clip_grad)
    run.directory.close()
  exact = norms["exact"]
  print(f"{args.mesh}, clipped by {args.clip_by} at {args.clip_grad}, {args.steps} steps:")
  for kind in ("sketch", "rms"):
    ratio = norms[kind] / exact
    worst = ratio[np.argmax(np.abs(np.log(ratio)))]
    print(f"  {kind} / exact: median {np.median(ratio):.4f}, worst {worst:.4f},"
          f" spread {np.std(ratio):.4f}")
  for kind in NORMS:
    print(f"  steps where {kind} > {args.clip_grad}: {int(np.sum(norms[kind] > args.clip_grad))};"
          f" median {kind} {np.median(norms[kind]):.4f}")
  print(f"  final validation loss {loss:.6f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"mesh": args.mesh, "clip_by": args.clip_by, "val_loss": loss,
                 **{k: v.tolist() for k, v in norms.items()}}, f)


def _train(run, clip_by: str, clip_grad: float) -> tuple[dict[str, np.ndarray], float]:
  """``run`` (``train.run.setup.Run``) stepped with every norm taken, clipped by ``clip_by``'s."""
  import jax
  import optax

  import models
  from train.run import grad_norm, loop, optim, trainer
  from train.run import step as step_lib

  cfg, mesh, params = run.cfg, run.mesh, run.state.params
  par, accum = trainer.parallelism(cfg, mesh)
  graphdef, _ = models.abstract(run.model_cfg, par)
  specs = models.param_specs(params)
  per_replica = optim.per_replica_mask(cfg, params, mesh)
  tx = optim.optimizer(cfg, params, mesh, specs)
  gradient = step_lib.make_gradient(graphdef, par, per_replica, accum)

  @jax.jit
  def step(params, opt_state, batch, count):
    _, grads = gradient(params, batch)
    norms = {k: grad_norm.global_norm(grads, per_replica, k, cfg.grad_norm_sketch_size, count, mesh, specs)
             for k in grad_norm.NORMS}
    factor = jax.numpy.minimum(1.0, clip_grad / jax.numpy.maximum(norms[clip_by], 1e-30))
    updates, opt_state = tx.update(jax.tree.map(lambda g: g * factor, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, norms

  opt_state, seen = run.state.opt_state, {k: [] for k in grad_norm.NORMS}
  with jax.set_mesh(mesh):
    for count in range(cfg.steps):
      batch = run.data.to_global(next(run.data.loader))
      params, opt_state, norms = step(params, opt_state, batch, count)
      for k, v in jax.device_get(norms).items():
        seen[k].append(float(v))
  loss, _ = loop.evaluate(run, run.state._replace(params=params))
  return {k: np.asarray(v) for k, v in seen.items()}, loss


if __name__ == "__main__":
  main()
