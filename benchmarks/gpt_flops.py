"""Compiled flops of the GPT's training step: the pipeline's overhead and the model count.

    python -m benchmarks.gpt_flops            # pp = 2, 4 at 2..16 micro-batches, v = 1, 2

For each pipeline shape, XLA's cost analysis of the compiled forward+backward gives the
flops one device executes; times pp over the pp = 1 step's flops is the pipeline's
compute overhead, printed beside the schedule's bubble fraction (pp − 1)/(M·v + pp − 1)
as the overhead it implies, 1/(1 − bubble). Then the pp = 1 step's flops per token
against ``GPTConfig.flops_per_token()`` (6·N + 12·L·T·d), which the trainer's MFU uses.
The loops are unrolled (``unroll=True``) because the cost analysis counts a loop body
once. No timings: these are counts.
"""
import argparse
import sys

import jax
import jax.numpy as jnp

import models
from benchmarks import harness


def step_flops(cfg, batch_size, spec="", **options) -> float:
  """Flops of one device's compiled forward+backward on a batch of ``batch_size``."""
  mesh = harness.mesh(spec)
  par = models.Parallelism(mesh, **options)
  graphdef, params = models.init(cfg, par)
  tokens = jnp.zeros((batch_size, cfg.seq_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  with jax.set_mesh(mesh):
    fn = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par)))
    return fn.lower(params, batch).compile().cost_analysis()["flops"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpt_flops", description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--micro-batch-size", type=int, default=2)
  args = parser.parse_args(argv)
  harness.setup_process(cpu_devices=8)  # on CPU, the pp = 4 mesh's devices
  cfg = models.preset("tiny", num_layers=args.layers, d_model=args.d_model, seq_len=args.seq_len, unroll=True)

  print("pp  v   M  flops/device  overhead (pp·flops/flops_pp1)  1/(1-bubble)  bubble")
  for pp in (2, 4):
    for v in (1, 2):
      for M in (2, 4, 8, 16):
        if M % pp or cfg.num_layers % (pp * v):
          continue
        B = M * args.micro_batch_size
        base = step_flops(cfg, B)
        flops = step_flops(cfg, B, f"pp={pp}", microbatches=M, virtual_stages=v)
        bubble = (pp - 1) / (M * v + pp - 1)
        print(f"{pp:2d} {v:2d} {M:3d}  {flops:12.4g}  {pp * flops / base:29.3f}  {1 / (1 - bubble):12.3f}"
              f"  {bubble:6.3f}", flush=True)

  B = 4
  flops = step_flops(cfg, B)
  tokens = B * cfg.seq_len
  print(f"\nmodel flops per token: compiled {flops / tokens:.4g}, 6N + 12·L·T·d = {cfg.flops_per_token():.4g}"
        f" (ratio {flops / tokens / cfg.flops_per_token():.3f}); N = {cfg.num_params(embeddings=False):,}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
