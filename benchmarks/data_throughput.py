"""Tokens per second served by the data loader, and the embedded corpus's build time.

    python -m benchmarks.data_throughput [--batch 8] [--seq-len 256] [--steps 3000]

Measures, in one run: a cold build of the stdlib corpus (fresh cache folder), then the
Grain loader's throughput (inputs tokens per second, consumed by a tight Python loop) on
the embedded corpus, a FineWeb shard set, a Megatron dataset and a 0.7/0.3 blend, at the
default training shapes. The issue's target is >= 10x what one training step consumes.
"""
import argparse
import os
import shlex
import sys
import tempfile
import time

import numpy as np

import data
from data import corpus, fineweb, megatron


def throughput(source, args) -> tuple[float, float]:
  """(tokens/s over `args.steps` batches, seconds to the first batch)."""
  start = time.perf_counter()
  it = data.make_loader(source, seq_len=args.seq_len, global_batch_size=args.batch, seed=0,
                        num_threads=args.threads)
  next(it)
  first = time.perf_counter() - start
  start = time.perf_counter()
  tokens = 0
  for _ in range(args.steps):
    tokens += next(it)["inputs"].size
  return tokens / (time.perf_counter() - start), first


def main():
  parser = argparse.ArgumentParser(prog="python -m benchmarks.data_throughput", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
  parser.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
  parser.add_argument("--steps", type=int, default=3000, help="batches timed per source")
  parser.add_argument("--threads", type=int, default=4, help="Grain read threads")
  parser.add_argument("--synthetic-tokens", type=int, default=20_000_000,
                      help="tokens in the synthetic FineWeb / Megatron files")
  args = parser.parse_args()
  print("$ " + shlex.join(["python", "-m", "benchmarks.data_throughput", *sys.argv[1:]]))
  print(f"batch {args.batch} x seq_len {args.seq_len}, {args.steps} timed steps, "
        f"{args.threads} threads, {os.cpu_count()} CPUs")

  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    prefixes = corpus.build_corpus(cache_dir=os.path.join(tmp, "cache"), progress=False)
    build = time.perf_counter() - start
    sizes = {s: megatron.IndexedDataset(p) for s, p in prefixes.items()}
    print(f"stdlib corpus cold build: {build:.2f} s "
          f"(train {len(sizes['train'])} files / {sizes['train'].tokens.size:,} tokens, "
          f"val {len(sizes['val'])} files / {sizes['val'].tokens.size:,} tokens)")
    start = time.perf_counter()
    data.load_source("stdlib", cache_dir=os.path.join(tmp, "cache"), progress=False)
    print(f"stdlib corpus cached load: {1e3 * (time.perf_counter() - start):.1f} ms")

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=args.synthetic_tokens, dtype=np.uint16)
    half = len(tokens) // 2
    fineweb.write_shard(os.path.join(tmp, "fw_000000.bin"), tokens[:half])
    fineweb.write_shard(os.path.join(tmp, "fw_000001.bin"), tokens[half:])
    megatron.write_dataset(os.path.join(tmp, "mg"), np.split(tokens, 1000), np.uint16)
    specs = {
        "stdlib": "stdlib",
        "fineweb (2 shards)": os.path.join(tmp, "fw_*.bin"),
        "megatron": os.path.join(tmp, "mg"),
        "blend 0.7 stdlib / 0.3 fineweb": f"0.7:stdlib,0.3:{os.path.join(tmp, 'fw_*.bin')}",
    }
    print(f"{'source':34s} {'tokens/s':>14s} {'steps/s':>10s} {'first batch':>12s}")
    for name, spec in specs.items():
      source = data.load_source(spec, cache_dir=os.path.join(tmp, "cache"), progress=False)
      rate, first = throughput(source, args)
      steps = rate / (args.batch * args.seq_len)
      print(f"{name:34s} {rate:14,.0f} {steps:10,.0f} {1e3 * first:9.1f} ms")


if __name__ == "__main__":
  main()
