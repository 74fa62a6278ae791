"""Forward+backward time of the GPT on one device: ms per step, tokens/s, achieved TFLOP/s.

    python -m benchmarks.gpt_speed --preset tiny --batch-size 16
    python -m benchmarks.gpt_speed --preset small --batch-size 1 --steps 3

Times the jitted ``value_and_grad`` of ``models.loss`` (no optimizer, no data loading)
over ``--steps`` calls after one warm-up call, and reports the median. Flops are
``GPTConfig.flops_per_token()`` (6·N + 12·L·T·d) times the tokens of a step.
"""
import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import models
from benchmarks import harness  # noqa: F401  limits OpenBLAS's threads before any LAPACK call
from train.gpu import timing


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gpt_speed", description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(models.PRESETS))
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
  parser.add_argument("--dtype", default="float32", choices=models.config.COMPUTE_DTYPES)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args(argv)
  overrides = {"dtype": args.dtype} | ({"seq_len": args.seq_len} if args.seq_len else {})
  cfg = models.preset(args.preset, vocab_size=257, **overrides)
  graphdef, params = models.init(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 257, (args.batch_size, cfg.seq_len)), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  step = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b)))
  t = timing.time_fn(step, (params, batch), args.steps)
  tokens_per_step = args.batch_size * cfg.seq_len
  print(f"{args.preset} ({cfg.num_params() / 1e6:.1f}M params, vocab {cfg.padded_vocab}, {args.dtype}) on"
        f" {jax.devices()[0].platform}: batch {args.batch_size} x {cfg.seq_len}: {t * 1e3:.1f} ms per"
        f" forward+backward, {tokens_per_step / t:,.0f} tokens/s,"
        f" {cfg.flops_per_token() * tokens_per_step / t / 1e12:.3f} TFLOP/s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
