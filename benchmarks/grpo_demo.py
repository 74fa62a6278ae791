"""GRPO teaches a tiny byte-level GPT to reverse words on CPU, in two minutes:
``python -m benchmarks.grpo_demo --out benchmarks/results/grpo``.

The task: a prompt ``"abc="`` of three random lowercase letters, answered ``"#### cba"``
(checked by the built-in ``answer`` reward; ``format`` gives 0.2 for any ``#### x``). It
runs three commands, printed as they start:

1. ``python -m train.gpt --data sft:RUNS/sft.jsonl`` trains a 2-layer, 64-wide GPT (byte
   tokenizer, no checkpoint needed) on ``--sft-steps`` batches of written-out reversals,
   stopped early on purpose, so that it knows the format and reverses some words but not
   most;
2. ``python -m train.grpo --init-from`` that run on ``RUNS/prompts.jsonl`` (other words,
   with their ``answer`` column), 16 prompts x 8 completions a step;
3. ``python -m train.plot`` of the GRPO run into ``OUT/reward.png``.

It then prints and writes to ``OUT/summary.json`` the mean reward of the first and last
10 GRPO steps and the median time of a step's rollout and training (step 1, which
compiles, left out). The two runs go to ``--runs`` (default ``runs/grpo_demo/``, which git
ignores) with their data, replaced on each call.
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


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results/grpo")
  parser.add_argument("--runs", default="runs/grpo_demo", help="directory for the SFT and GRPO runs")
  parser.add_argument("--sft-steps", type=int, default=120)
  parser.add_argument("--grpo-steps", type=int, default=150)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  shutil.rmtree(args.runs, ignore_errors=True)
  sft_run, grpo_run = os.path.join(args.runs, "sft"), os.path.join(args.runs, "grpo")
  os.makedirs(args.runs)
  sft_data, prompts = write_data(args.runs, args.seed)

  run(["train.gpt", "--data", f"sft:{sft_data}", *MODEL, "--optimizer", "adamw", "--lr", "3e-3",
       "--steps", str(args.sft_steps), "--global-batch-size", "16", "--mesh", "fs=1", "--log-interval", "20",
       "--eval-every", str(args.sft_steps + 1), "--save-every", str(args.sft_steps), "--seed", str(args.seed),
       "--run-dir", sft_run])
  run(["train.grpo", "--init-from", sft_run, "--prompts", prompts, "--reward", "answer", "--reward", "format=0.2",
       "--steps", str(args.grpo_steps), "--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "10",
       "--optimizer", "adamw", "--lr", "2e-3", "--lr-decay-style", "constant", "--lr-warmup-steps", "0",
       "--updates-per-rollout", "2", "--save-every", str(args.grpo_steps), "--mesh", "fs=1",
       "--seed", str(args.seed), "--run-dir", grpo_run])
  figure = os.path.join(args.out, "reward.png")
  run(["train.plot", grpo_run, "--output", figure])

  with open(os.path.join(grpo_run, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  reward = [r["reward_mean"] for r in records]
  answered = [r["reward/answer/mean"] for r in records]
  summary = {"sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps,
             "reward_first10": float(np.mean(reward[:10])), "reward_last10": float(np.mean(reward[-10:])),
             "answer_first10": float(np.mean(answered[:10])), "answer_last10": float(np.mean(answered[-10:])),
             "rollout_s_median": float(np.median([r["rollout_s"] for r in records[1:]])),
             "train_s_median": float(np.median([r["train_s"] for r in records[1:]])),
             "truncated_last10": float(np.mean([r["truncated"] for r in records[-10:]]))}
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"reward (answer + 0.2 format), mean of steps 1-10: {summary['reward_first10']:.3f}, of the last 10:"
        f" {summary['reward_last10']:.3f}; words reversed {summary['answer_first10']:.1%} ->"
        f" {summary['answer_last10']:.1%}")
  print(f"per step (median, step 1 left out): rollout {summary['rollout_s_median']:.3f} s, training"
        f" {summary['train_s_median']:.3f} s; curve: {figure}")


if __name__ == "__main__":
  main()
