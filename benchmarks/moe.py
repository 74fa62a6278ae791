"""Mixture of experts: speed and quality against a dense model, all-to-all bytes, memory.

    python -m benchmarks.moe                         # every stage
    python -m benchmarks.moe --stage alltoall memory

Stages (fake CPU devices):

- ``speed``: tokens/s of the training step (gradient + Dion, one CPU device) of
  ``tiny-moe`` (8 experts of width 256, 2 per token) against ``tiny`` (dense MLP of width
  512: the same active MLP parameters), dropless and with capacity factor 1, and of tiny
  with such experts on every second layer only (:data:`EVERY_2ND`), interleaved rounds.
- ``quality``: ``python -m train.gpt --preset tiny-moe``, ``--preset tiny`` and tiny with
  experts on every second layer at their defaults (200 steps, the same tokens): final
  training loss and validation loss.
- ``alltoall``: the all-to-all bytes per device of one training step of ``tiny-moe`` on
  ep = 2 and 4, against the formula. Per layer, the rows go out and come back in the
  forward pass, again in the backward pass's recomputation, and both are transposed:
  6 all-to-alls of ``ep · S · D · 4`` bytes, S the rows each destination has room for:
  ``b·T·k`` dropless (every assignment may go to one rank), ``min(b·T·k, E/ep · b · C)``
  with capacity C per sequence (``b·T·k/ep`` each at capacity factor 1: exactly the
  device's tokens × k rows in all); plus 2 of the row counts. The layer scan's body
  counts once.
- ``memory``: compiled arguments and temporaries per device of the training step of an
  8-expert model (``small``'s shape, 4 layers, 8 experts of width 768·2, top-2) on
  8 devices as fs=8 (ep=1), fs=4,ep=2 and fs=2,ep=4, and on fs=2 with ep = 1, 2, 4 (2, 4, 8
  devices: the batch per device shrinks too), from ``compiled.memory_analysis()``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks import harness

harness.setup_process(cpu_devices=8, platform="cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import dion_jax  # noqa: E402
import models  # noqa: E402
from train.gpu import timing  # noqa: E402

STAGES = ("speed", "quality", "alltoall", "memory")
# tiny with 8 experts of width 256, top-2, on layers 1 and 3 (dense MLPs of 512 on 0 and 2):
# tiny's active parameters in every layer.
EVERY_2ND = dict(num_experts=8, moe_every=2, moe_mlp_dim=256)


def _batch(cfg: models.GPTConfig, batch: int, seed: int = 0) -> dict:
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def _train_step(cfg: models.GPTConfig, par: models.Parallelism):
  graphdef, params = models.init(cfg, par)
  tx = dion_jax.dion(0.02, mesh=par.mesh, partition_specs=models.param_specs(params) if par.mesh else None)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: models.loss(graphdef, p, batch, par))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, params, tx


def speed(args) -> None:
  cases, batch = {}, _batch(models.preset("tiny"), args.batch)
  configs = {"tiny (dense)": models.preset("tiny"), "tiny-moe dropless": models.preset("tiny-moe"),
             "tiny-moe capacity 1": models.preset("tiny-moe", moe_capacity_factor=1.0),
             "tiny, experts every 2nd layer": models.preset("tiny", **EVERY_2ND)}
  for name, cfg in configs.items():
    step, params, tx = _train_step(cfg, models.Parallelism())
    cases[name] = (jax.jit(step), (params, tx.init(params), batch))
  times = timing.interleaved_times(cases, rounds=args.rounds, repeats=3)
  tokens = args.batch * configs["tiny (dense)"].seq_len
  dense = times["tiny (dense)"]
  print("| model | ms/step | tokens/s | × dense |\n| --- | --- | --- | --- |")
  for name, t in times.items():
    print(f"| {name} | {1e3 * t:.1f} | {tokens / t:.0f} | {dense / t:.2f} |")


def quality(args) -> None:
  print("| preset | train loss | validation loss | tokens/s |\n| --- | --- | --- | --- |")
  with tempfile.TemporaryDirectory() as tmp:
    every_2nd = "tiny --num-experts 8 --moe-every 2 --moe-ffn-hidden-size 256"
    for preset in ("tiny", "tiny-moe", every_2nd):
      run = os.path.join(tmp, preset.replace(" ", "_"))
      subprocess.run([sys.executable, "-m", "train.gpt", "--preset", *preset.split(), "--run-dir", run],
                     check=True, stdout=subprocess.DEVNULL)
      with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
      train = [r for r in records if "loss" in r]
      val = [r["val_loss"] for r in records if "val_loss" in r][-1]
      speed = np.median([r["tokens_per_s"] for r in train[1:]])
      print(f"| {preset} | {train[-1]['loss']:.3f} | {val:.3f} | {speed:.0f} |")


def alltoall(args) -> None:
  print("| mesh | routing | all-to-alls | MiB measured | MiB formula |\n| --- | --- | --- | --- | --- |")
  batch = args.batch
  for spec in ("fs=4,ep=2", "fs=2,ep=4"):
    mesh = harness.mesh(spec)
    sizes = dict(mesh.shape)
    for capacity in (None, 1.0):
      cfg = models.preset("tiny-moe", moe_capacity_factor=capacity)
      par = models.Parallelism(mesh)
      graphdef, params = models.init(cfg, par)
      with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par))).lower(
            params, _batch(cfg, batch)).compile()
      stats = [s for s in dion_jax.collective_stats(compiled, mesh) if s.op == "all-to-all"]
      ep, E, k, T, D = sizes["ep"], cfg.num_experts, cfg.moe_top_k, cfg.seq_len, cfg.d_model
      b = batch // (sizes["rp"] * sizes["fs"] * ep)
      C = models.moe.capacity(cfg, T)
      slots = b * T * k if C is None else min(b * T * k, E // ep * b * C)
      formula = 6 * ep * slots * D * 4 + 2 * ep * (E // ep) * 4
      measured = sum(s.bytes for s in stats)
      print(f"| {spec} | {'dropless' if C is None else f'capacity {capacity:g}'} | {sum(s.count for s in stats)}"
            f" | {measured / 2**20:.3f} | {formula / 2**20:.3f} |")


def memory(args) -> None:
  cfg = models.preset("small", num_layers=4, num_experts=8, mlp_dim=2 * 768, vocab_size=50257)
  print(f"{cfg.num_params() / 1e6:.0f}M parameters ({cfg.num_params(active=True) / 1e6:.0f}M active),"
        f" batch {args.batch} x {cfg.seq_len}, float32\n")
  print("| mesh | arguments MiB | temporaries MiB |\n| --- | --- | --- |")
  for spec in ("fs=8", "fs=4,ep=2", "fs=2,ep=4", "fs=2", "fs=2,ep=2"):
    mesh = harness.mesh(spec)
    par = models.Parallelism(mesh)
    graphdef, shapes = models.abstract(cfg, par)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(models.BATCH_AXES))), _batch(cfg, args.batch))
    with jax.set_mesh(mesh):
      compiled = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par))).lower(
          shapes, batch).compile()
    mem = compiled.memory_analysis()
    print(f"| {spec} | {mem.argument_size_in_bytes / 2**20:.1f} | {mem.temp_size_in_bytes / 2**20:.1f} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--stage", nargs="+", choices=STAGES, default=list(STAGES))
  parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16, the trainer's)")
  parser.add_argument("--rounds", type=int, default=5, help="speed: interleaved rounds (default 5)")
  args = parser.parse_args(argv)
  for stage in args.stage:
    print(f"\n## {stage}\n")
    globals()[stage](args)


if __name__ == "__main__":
  main()
