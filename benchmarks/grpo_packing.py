"""GRPO's update on packed rows against one completion to a row, in one process:
``python -m benchmarks.grpo_packing --out benchmarks/results/grpo_packing.json``.

Two rollouts, each laid out both ways (``train/grpo/batch.py``) and updated by the run's own
jitted step (``python -m train.grpo``'s, AdamW), the two layouts' updates interleaved,
``--repeats`` (25) each after a compiling one; the update's tokens/s is the rollout's completion
tokens over the median update time (``metrics.jsonl``'s ``train_tokens_per_s`` per update):

- ``demo``: the README demo's first GRPO rollouts (``benchmarks/grpo_demo.py``: the 2-layer,
  64-wide byte-level GPT after its 120 SFT steps, 16 prompts x 8 completions of up to 10
  tokens after 4-token prompts), ``--demo-steps`` of them, sampled by the run itself;
- ``wide``: one rollout whose lengths vary widely, drawn rather than sampled (a model
  samples lengths it has learned): the ``tiny`` preset (4 layers x 128, seq_len 128), 128
  completions of 1 to 64 tokens after prompts of 1 to 64, uniformly.

The machine is shared: read the medians, which interleaving keeps comparable.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from benchmarks import grpo_demo
from benchmarks import harness  # before JAX: OpenBLAS's threads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from train.grpo import batch as grpo_batch  # noqa: E402
from train.grpo import loop as grpo_loop  # noqa: E402
from train.grpo import rollout as grpo_rollout  # noqa: E402
from train.grpo import objective as grpo_objective  # noqa: E402

GRPO_FLAGS = ["--optimizer", "adamw", "--lr", "1e-3", "--lr-decay-style", "constant", "--lr-warmup-steps", "0",
              "--mesh", "fs=1", "--reward", "answer", "--reward", "format=0.2"]


def _train(args: list[str]) -> None:
  subprocess.run([sys.executable, "-m", "train.gpt", *args], check=True, stdout=subprocess.DEVNULL)


def _setup(runs: str, name: str, init_from: str, prompts: str, *flags: str):
  """``python -m train.grpo``'s run (its first rollout made and its step compiled)."""
  return grpo_loop.setup(["--init-from", init_from, "--prompts", prompts, "--run-dir", os.path.join(runs, name),
                          "--steps", "100", *GRPO_FLAGS, *flags])


def _timed(run, batches: dict[str, dict], tokens: int, repeats: int) -> dict:
  """Each batch's update, interleaved: the median seconds and completion tokens/s."""
  state, seconds = run.state, {name: [] for name in batches}
  for repeat in range(repeats + 1):
    for name in (list(batches) if repeat % 2 else list(batches)[::-1]):
      t0 = time.perf_counter()
      with jax.set_mesh(run.mesh):
        state, metrics = run.train_step(state, batches[name])
      jax.device_get(metrics)
      if repeat:  # the first compiles
        seconds[name].append(time.perf_counter() - t0)
  run.state = state
  return {name: {"update_s": float(np.median(s)), "tokens_per_s": tokens / float(np.median(s)),
                 "rows": list(batches[name]["inputs"].shape)} for name, s in seconds.items()}


def demo(runs: str, steps: int, repeats: int) -> dict:
  """The demo's rollouts: the run samples each step's both ways (same seed, same policy)."""
  data_dir = os.path.join(runs, "data")
  os.makedirs(data_dir)
  sft_data, prompts = grpo_demo.write_data(data_dir, 0)
  sft_run = os.path.join(runs, "sft")
  _train(["--data", f"sft:{sft_data}", *grpo_demo.MODEL, "--optimizer", "adamw", "--lr", "3e-3", "--steps", "120",
          "--global-batch-size", "16", "--mesh", "fs=1", "--eval-every", "121", "--save-every", "120",
          "--run-dir", sft_run])
  run = _setup(runs, "grpo-demo", sft_run, prompts, "--prompts-per-step", "16", "--group-size", "8",
               "--max-new-tokens", "10", "--updates-per-rollout", "2")
  out = []
  for step in range(1, steps + 1):
    made = {}
    for pack in (True, False):
      run.data = run.data._replace(grpo=dataclasses.replace(run.data.grpo, pack=pack))
      made["packed" if pack else "padded"] = grpo_rollout.rollout(run, run.state, step)
    tokens = int(made["packed"].lengths_B.sum())
    out.append({"step": step, "completion_tokens": tokens,
                **_timed(run, {name: m.batch for name, m in made.items()}, tokens, repeats)})
  run.checkpoints.close()
  run.directory.close()
  return {"rollouts": out, **_summary(out)}


def wide(runs: str, repeats: int, seed: int = 0) -> dict:
  """A drawn rollout of widely varying lengths on the tiny preset; old log-probs the policy's."""
  base = os.path.join(runs, "tiny")
  _train(["--preset", "tiny", "--data", "stdlib", "--steps", "1", "--global-batch-size", "8", "--mesh", "fs=1",
          "--eval-every", "0", "--eval-tokens", "0", "--save-every", "1", "--run-dir", base])
  prompts_file = os.path.join(runs, "wide-prompts.jsonl")
  with open(prompts_file, "w") as f:
    f.write(json.dumps({"prompt": "x" * 60, "answer": "y"}) + "\n")
  run = _setup(runs, "grpo-wide", base, prompts_file, "--prompts-per-step", "16", "--group-size", "8",
               "--max-new-tokens", "64")
  rng = np.random.default_rng(seed)
  B, M = 128, 64
  prompts = [rng.integers(1, 256, n).astype(np.int32) for n in rng.integers(1, 65, B)]
  completions_BxM, lengths_B = rng.integers(1, 256, (B, M)).astype(np.int32), rng.integers(1, M + 1, B)
  layouts = {"packed": grpo_batch.packed(prompts, completions_BxM, lengths_B, run.model_cfg.seq_len),
             "padded": grpo_batch.padded(prompts, completions_BxM, lengths_B)}
  mask_BxM = jnp.asarray(np.arange(M)[None] < lengths_B[:, None], jnp.float32)
  old_BxM = grpo_batch.token_logps(run.data.graphdef, run.state.params, layouts["padded"], 1.0)
  fields = grpo_objective.per_token_fields(old_BxM, None, jnp.asarray(rng.normal(size=B), jnp.float32), mask_BxM,
                                           run.data.objective, mask_BxM.sum())
  tokens = int(lengths_B.sum())
  timed = _timed(run, {name: grpo_batch.update_batch(layout, fields) for name, layout in layouts.items()}, tokens,
                 repeats)
  run.checkpoints.close()
  run.directory.close()
  out = [{"completion_tokens": tokens, "prompt_and_completion_tokens": int(sum(map(len, prompts)) + tokens), **timed}]
  return {"rollouts": out, **_summary(out)}


def _summary(rollouts: list[dict]) -> dict:
  packed, padded = ([r[name]["tokens_per_s"] for r in rollouts] for name in ("packed", "padded"))
  return {"packed_tokens_per_s": float(np.median(packed)), "padded_tokens_per_s": float(np.median(padded)),
          "speedup": float(np.median(np.asarray(packed) / np.asarray(padded)))}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_packing", description=" ".join(__doc__.split("\n\n")[0].split()))
  harness.add_out(parser, "benchmarks/results/grpo_packing.json", "the JSON of the timings")
  parser.add_argument("--runs", default="runs/grpo_packing", help="directory for the runs, replaced")
  parser.add_argument("--demo-steps", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=25)
  args = parser.parse_args(argv)
  shutil.rmtree(args.runs, ignore_errors=True)
  os.makedirs(args.runs)
  results = {"device": jax.devices()[0].device_kind, "repeats": args.repeats,
             "demo": demo(args.runs, args.demo_steps, args.repeats), "wide": wide(args.runs, args.repeats)}
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)
  for case in ("demo", "wide"):
    r = results[case]
    rows = {name: r["rollouts"][0][name]["rows"] for name in ("packed", "padded")}
    print(f"{case}: update {r['padded_tokens_per_s']:.0f} -> {r['packed_tokens_per_s']:.0f} completion tokens/s"
          f" (x{r['speedup']:.2f}; rows {rows['padded']} -> {rows['packed']})")


if __name__ == "__main__":
  main()
