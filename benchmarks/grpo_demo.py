"""GRPO teaches a tiny byte-level GPT to reverse words on CPU, in a few minutes:
``python -m benchmarks.grpo_demo --out benchmarks/results/grpo`` (without ``--out`` it writes
under ``runs/benchmarks/grpo``, leaving the committed results as they are).

The task: a prompt ``"abc="`` of three random lowercase letters, answered ``"#### cba"``
(checked by the built-in ``answer`` reward; ``format`` gives 0.2 for any ``#### x``). It
runs three commands, printed as they start:

1. ``python -m train.gpt --data sft:RUNS/data-seedN/sft.jsonl`` trains a 2-layer, 64-wide GPT (byte
   tokenizer, no checkpoint needed) on ``--sft-steps`` batches of written-out reversals,
   stopped early on purpose, so that it knows the format and reverses some words but not
   most;
2. ``python -m train.grpo --init-from`` that run on ``RUNS/data-seedN/prompts.jsonl`` (other words,
   with their ``answer`` column), 16 prompts x 8 completions a step, AdamW at a constant 1e-3;
3. ``python -m train.plot`` of the GRPO runs into ``OUT/reward.png``.

It does so for each of ``--seeds`` (default 0, 1, 2: the data, the SFT initialization and
order, the prompts' order and the sampler), then prints and writes to ``OUT/summary.json``
per seed and as mean and sample std over the seeds the mean reward of the first and last
10 GRPO steps and the median time of a step's rollout and training (step 1, which
compiles, left out). The runs go to ``--runs`` (default ``runs/grpo_demo/``, which git
ignores) with their data, replaced on each call.

The end of a seed's run depends on the machine: XLA's CPU backend sums a weight gradient
(and any long reduction) in an order that depends on how many cores it may use, and
sampling turns that last-bit difference into other completions within a few steps. With
the earlier recipe (AdamW at 2e-3), seed 0 of one commit ended at 0.864 on 2 cores and at
0.913 under ``taskset -c 0`` (a user's machine: 0.737), and seed 1 collapsed to the format
reward alone (0.200) before and after GRPO moved onto train.gpt's step. Hence the mean and
spread over seeds, and the lower learning rate, at which no seed collapsed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np

from benchmarks import harness

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MODEL = ["--preset", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-len", "32"]


def write_data(runs: str, seed: int, sft_rows: int = 2000, prompt_rows: int = 500) -> tuple[str, str]:
  """``RUNS/sft.jsonl`` ({"prompt", "completion"}) and ``RUNS/prompts.jsonl`` ({"prompt",
  "answer"}) of random three-letter words; the two sets are drawn independently."""
  rng = random.Random(seed)

  def word() -> str:
    return "".join(rng.choice(LETTERS) for _ in range(3))

  sft, prompts = os.path.join(runs, "sft.jsonl"), os.path.join(runs, "prompts.jsonl")
  with open(sft, "w") as f:
    for w in (word() for _ in range(sft_rows)):
      f.write(json.dumps({"prompt": f"{w}=", "completion": f"#### {w[::-1]}"}) + "\n")
  with open(prompts, "w") as f:
    for w in (word() for _ in range(prompt_rows)):
      f.write(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n")
  return sft, prompts


def run(command: list[str]) -> None:
  print("$ python -m " + " ".join(command), flush=True)
  subprocess.run([sys.executable, "-m", *command], check=True)


def demonstrate(runs: str, seed: int, sft_steps: int, grpo_steps: int) -> dict:
  """The SFT and GRPO runs of one seed under ``runs`` (``sft-seedN``, ``grpo-seedN``, their
  data in ``data-seedN``); their summary (module docstring)."""
  sft_run, grpo_run = os.path.join(runs, f"sft-seed{seed}"), os.path.join(runs, f"grpo-seed{seed}")
  os.makedirs(os.path.join(runs, f"data-seed{seed}"))
  sft_data, prompts = write_data(os.path.join(runs, f"data-seed{seed}"), seed)
  run(["train.gpt", "--data", f"sft:{sft_data}", *MODEL, "--optimizer", "adamw", "--lr", "3e-3",
       "--steps", str(sft_steps), "--global-batch-size", "16", "--mesh", "fs=1", "--log-interval", "20",
       "--eval-every", str(sft_steps + 1), "--save-every", str(sft_steps), "--seed", str(seed),
       "--run-dir", sft_run])
  run(["train.grpo", "--init-from", sft_run, "--prompts", prompts, "--reward", "answer", "--reward", "format=0.2",
       "--steps", str(grpo_steps), "--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "10",
       "--optimizer", "adamw", "--lr", "1e-3", "--lr-decay-style", "constant", "--lr-warmup-steps", "0",
       "--updates-per-rollout", "2", "--save-every", str(grpo_steps), "--mesh", "fs=1",
       "--seed", str(seed), "--run-dir", grpo_run])
  with open(os.path.join(grpo_run, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  reward = [r["reward_mean"] for r in records]
  answered = [r["reward/answer/mean"] for r in records]
  return {"reward_first10": float(np.mean(reward[:10])), "reward_last10": float(np.mean(reward[-10:])),
          "answer_first10": float(np.mean(answered[:10])), "answer_last10": float(np.mean(answered[-10:])),
          "rollout_s_median": float(np.median([r["rollout_s"] for r in records[1:]])),
          "train_s_median": float(np.median([r["train_s"] for r in records[1:]])),
          "truncated_last10": float(np.mean([r["truncated"] for r in records[-10:]]))}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_demo",
                                   description="GRPO teaches a tiny byte-level GPT to reverse words on CPU, in a"
                                               " few minutes (the module docstring says how).")
  harness.add_out(parser, "benchmarks/results/grpo", "the table, figure and samples")
  parser.add_argument("--runs", default="runs/grpo_demo", help="directory for the SFT and GRPO runs")
  parser.add_argument("--sft-steps", type=int, default=120)
  parser.add_argument("--grpo-steps", type=int, default=150)
  parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one SFT + GRPO pair each")
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  os.makedirs(args.out, exist_ok=True)
  shutil.rmtree(args.runs, ignore_errors=True)
  per_seed = {seed: demonstrate(args.runs, seed, args.sft_steps, args.grpo_steps) for seed in seeds}
  figure = os.path.join(args.out, "reward.png")
  run(["train.plot", *(os.path.join(args.runs, f"grpo-seed{seed}") for seed in seeds), "--output", figure])
  summary = {"sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps, "seeds": per_seed}
  for key in next(iter(per_seed.values())):  # mean and spread (sample std) over the seeds
    values = [s[key] for s in per_seed.values()]
    summary[key] = {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  for seed, s in per_seed.items():
    print(f"seed {seed}: reward (answer + 0.2 format) {s['reward_first10']:.3f} over steps 1-10 -> {s['reward_last10']:.3f}"
          f" over the last 10; words reversed {s['answer_first10']:.1%} -> {s['answer_last10']:.1%}")
  mean = lambda key: summary[key]["mean"]  # noqa: E731
  std = lambda key: summary[key]["std"]  # noqa: E731
  print(f"over seeds {args.seeds}: reward {mean('reward_first10'):.3f} ± {std('reward_first10'):.3f} ->"
        f" {mean('reward_last10'):.3f} ± {std('reward_last10'):.3f}; words reversed {mean('answer_first10'):.1%} ->"
        f" {mean('answer_last10'):.1%} ± {std('answer_last10'):.1%}")
  print(f"per step (median, step 1 left out): rollout {mean('rollout_s_median'):.3f} s, training"
        f" {mean('train_s_median'):.3f} s; curves: {figure}")


if __name__ == "__main__":
  main()
