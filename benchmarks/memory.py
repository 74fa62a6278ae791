"""Memory, time and loss of the trainer's step under each recompute policy (``--remat``) and
with the optimizer state in host memory (``--offload-optimizer``): docs/memory.md's tables.

    python -m benchmarks.memory compile    # compile only: each policy's compiled step, small (12 layers)
    python -m benchmarks.memory train      # 20 steps of train.gpt per policy, small's width, 2 layers, T=256

``compile`` builds the step ``python -m train.gpt`` runs (``train.run.trainer.make_trainer``)
on one CPU device and reads XLA's ``memory_analysis()``: arguments, outputs, aliased,
temporaries. On XLA:CPU the arguments and outputs kept in pinned host memory are counted
with the device's (XLA:CPU reports no host figures), so the host column is the bytes of the
step's arguments whose sharding is ``pinned_host``, and the device column the rest.
``train`` runs ``python -m train.gpt`` per policy (and with and without
``--offload-optimizer`` for Dion and AdamW) and reports the median step time of steps
3-20 and the loss at each step against ``none``'s (or the run without the offload).
Tables go to stdout; ``--out FILE`` also writes them there (nothing is written into
benchmarks/results unless FILE is there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import harness

POLICIES = ("none", "full", "selective", "save_qkv_proj", "save_dot_except_mlp", "save_out_proj",
            "qkv_proj_offloaded", "minimal_offloaded")
MIB = 2**20


def _compiled(preset: str, policy: str, optimizer: str, offload: bool, batch: int, layers: int | None):
  """The trainer's compiled step and its state on one CPU device, float32."""
  import jax
  import numpy as np

  import models
  from train.run import config as config_lib
  from train.run import trainer

  flags = ["--preset", preset, "--remat", policy, "--optimizer", optimizer, "--global-batch-size", str(batch),
           "--mesh", "fs=1", *(["--offload-optimizer"] if offload else [])]
  cfg = config_lib.parse(flags)
  model_cfg = models.preset(preset, remat=policy, dtype="float32", **({"num_layers": layers} if layers else {}))
  mesh = harness.mesh("fs=1")
  par, accum = trainer.parallelism(cfg, mesh)
  with jax.set_mesh(mesh):
    graphdef, params = models.init(model_cfg, par)
    state, step = trainer.make_trainer(cfg, model_cfg, graphdef, params, par, accum)
    tokens = jax.ShapeDtypeStruct((batch, model_cfg.seq_len), np.int32)
    return step.lower(state, {"inputs": tokens, "targets": tokens}).compile(), state


def host_bytes(tree) -> int:
  """Bytes per device of ``tree``'s arrays in pinned host memory."""
  import jax
  import numpy as np

  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
             if x.sharding.memory_kind == "pinned_host")


def memory_row(compiled, state) -> dict:
  m = compiled.memory_analysis()
  host = host_bytes(state)
  total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes, "aliased": m.alias_size_in_bytes,
          "temporaries": m.temp_size_in_bytes, "device": total - host, "host": host,
          "xla_host": m.host_argument_size_in_bytes + m.host_output_size_in_bytes + m.host_temp_size_in_bytes}


def compile_tables(args) -> str:
  lines = [f"### {args.preset}, {args.layers or 'all'} layers, global batch {args.batch}, float32, one CPU device,"
           " Dion (MiB per device)", "",
           "| policy | arguments | outputs | aliased | temporaries | device | host | XLA's host fields |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  print("\n".join(lines), flush=True)
  rows = [(p, "dion", False) for p in args.policies]
  rows += [("none", "dion", True), ("none", "adamw", False), ("none", "adamw", True)]
  for policy, optimizer, offload in rows:
    compiled, state = _compiled(args.preset, policy, optimizer, offload, args.batch, args.layers)
    r = memory_row(compiled, state)
    name = policy if (optimizer, offload) == ("dion", False) else f"{policy}, {optimizer}"
    name += ", --offload-optimizer" if offload else ""
    columns = ("arguments", "outputs", "aliased", "temporaries", "device", "host", "xla_host")
    lines.append(f"| {name} | " + " | ".join(f"{r[k] / MIB:,.1f}" for k in columns) + " |")
    print(lines[-1], flush=True)
  return "\n".join(lines)


def _run(flags: list[str], directory: str) -> dict[int, dict]:
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  subprocess.run([sys.executable, "-m", "train.gpt", *flags, "--run-dir", directory], check=True, env=env,
                 stdout=subprocess.DEVNULL)
  with open(os.path.join(directory, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def train_tables(args) -> str:
  base = ["--preset", args.preset, "--num-layers", str(args.train_layers), "--seq-len", str(args.train_seq_len),
          "--global-batch-size", str(args.train_batch), "--steps", str(args.steps), "--log-interval", "1",
          "--eval-every", "0", "--eval-tokens", "0", "--save-every", "0", "--mesh", "fs=1", "--dtype", "float32"]
  lines = [f"### {args.preset}'s width, {args.train_layers} layers, seq {args.train_seq_len}, global batch"
           f" {args.train_batch}, the embedded corpus (257 tokens), {args.steps} steps, Dion unless named, one CPU"
           " device, float32 (a shared 2-core machine)", "",
           "| run | median ms/step (steps 3-) | / reference | loss at step 1 | at the last step"
           " | largest |loss - reference's| |", "| --- | ---: | ---: | ---: | ---: | ---: |"]

  print("\n".join(lines), flush=True)

  def row(name, runs, reference):
    times = [runs[s]["ms_per_step"] for s in runs if s >= 3]
    ref_times = [reference[s]["ms_per_step"] for s in reference if s >= 3]
    worst = max(abs(runs[s]["loss"] - reference[s]["loss"]) for s in reference)
    last = max(runs)
    median = statistics.median(times)
    lines.append(f"| {name} | {median:,.0f} | {median / statistics.median(ref_times):.2f}"
                 f" | {runs[1]['loss']:.6f} | {runs[last]['loss']:.6f} | {worst:.2e} |")
    print(lines[-1], flush=True)

  with tempfile.TemporaryDirectory() as tmp:
    reference = None
    for policy in args.policies:
      runs = _run([*base, "--remat", policy], os.path.join(tmp, policy))
      reference = reference or runs
      row(f"--remat {policy}", runs, reference)
    for optimizer in ("dion", "adamw"):
      plain = reference if optimizer == "dion" else _run([*base, "--optimizer", optimizer], os.path.join(tmp, optimizer))
      if optimizer != "dion":
        row(f"{optimizer}", plain, plain)
      offloaded = _run([*base, "--optimizer", optimizer, "--offload-optimizer"], os.path.join(tmp, optimizer + "-host"))
      row(f"{optimizer} --offload-optimizer", offloaded, plain)
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=" ".join(__doc__.split("\n\n")[0].split()))
  parser.add_argument("mode", choices=("compile", "train"),
                      help="compile: each policy's compiled step, its memory; train: train.gpt's runs, their times and losses")
  parser.add_argument("--preset", default="small", help="the model (default small)")
  parser.add_argument("--layers", type=int, default=None, help="compile: override the preset's layers")
  parser.add_argument("--train-layers", type=int, default=2, help="train: layers of the runs (default 2)")
  parser.add_argument("--train-seq-len", type=int, default=256, help="train: tokens per sequence (default 256)")
  parser.add_argument("--train-batch", type=int, default=4, help="train: global batch (default 4)")
  parser.add_argument("--batch", type=int, default=8, help="compile: global batch (default 8)")
  parser.add_argument("--steps", type=int, default=20, help="train: steps of each run (default 20)")
  parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                      help=f"the --remat policies (default all: {' '.join(POLICIES)})")
  parser.add_argument("--out", help="also write the table to this file")
  args = parser.parse_args()
  harness.setup_process(cpu_devices=1, platform="cpu")
  table = compile_tables(args) if args.mode == "compile" else train_tables(args)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
