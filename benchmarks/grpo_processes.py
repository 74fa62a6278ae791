"""Multi-process GRPO and the death of process 0, on one machine's CPUs:
``python -m benchmarks.grpo_processes --out benchmarks/results/grpo_processes.md``.

1. Two processes of ``python -m train.grpo`` (gloo on 127.0.0.1, 2 CPU devices each) against
   one process with the same 4 devices, for each ``--meshes`` x ``--optimizers``: the worst
   difference of a logged metric over ``--steps`` steps, and the median time of a step's
   rollout and update in each (step 1, which compiles, left out).
2. A resume on another process count: the first half of the steps on two processes, the rest
   on one, and the other way; the worst difference to the one-process run that never stopped.
3. Process 0 killed with its process group (SIGKILL, as the out-of-memory killer or a lost
   host) once step 3 is logged and step 2 saved, for ``train.gpt`` and ``train.grpo``, each under its agent (as
   shipped) and bare (the worker alone, as before ``train/run/agent.py``): the survivor's exit
   code, the lines it printed after the kill, the seconds until it ended, the checkpoints left
   and the lock; then ``--resume`` on one process against the one-process run that never
   stopped.

The model is a 2-layer, 32-wide byte-level GPT (``train.gpt``, 2 steps); the prompts are
sums (``"12+7="``), the rewards the share of digits in a completion and the format. The runs
go to ``--runs`` (default ``runs/grpo_processes/``), replaced on each call.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from benchmarks import harness

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-len", "32"]
GRPO = ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--beta", "0.04", "--lr", "1e-2",
        "--lr-decay-style", "constant", "--lr-warmup-steps", "0", "--reward", "benchmarks.grpo_processes:digits",
        "--reward", "format=0.5", "--save-every", "2"]
GPT = [*MODEL[:-2], "--seq-len", "16", "--global-batch-size", "8", "--eval-tokens", "0", "--log-interval", "1",
       "--mesh", "fs=2", "--save-every", "2", "--lr-decay-steps", "1000"]
TIMING = ("rollout_s", "train_s", "rollout_tokens_per_s", "train_tokens_per_s")
NOTE = ("\"Nothing (before)\": the same worker without its agent, as every process ran before"
        " train/run/agent.py. The last column compares train.gpt's loss (one process on fs=2 against the two"
        " processes' run: the float32 rounding of two programs) and every GRPO metric. On fs=4 the gradient's"
        " sum over 4 devices runs in another order across processes than within one.")


def digits(prompts, completions, **_):
  """The share of a completion's characters that are digits."""
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(command: str, args: list[str], processes: int, bare: bool = False, **popen) -> list[subprocess.Popen]:
  """``python -m command args`` as ``processes`` processes on 127.0.0.1, each in a process group
  of its own; ``bare``: the worker without its agent."""
  if processes == 1:
    return [subprocess.Popen([sys.executable, "-m", command, *args], **popen)]
  port, procs = free_port(), []
  for i in range(processes):
    env, fds = dict(os.environ), ()
    if bare:  # what the agent hands its worker, with no agent reading it
      reports, fd = os.pipe()
      os.set_blocking(fd, False)
      env["DION_JAX_AGENT_FD"], fds = str(fd), (fd,)
    procs.append(subprocess.Popen([sys.executable, "-m", command, *args, "--coordinator", f"127.0.0.1:{port}",
                                   "--num-processes", str(processes), "--process-id", str(i)],
                                  env=env, pass_fds=fds, start_new_session=True, **popen))
  return procs


def run(command: str, args: list[str], processes: int = 1) -> None:
  procs = start(command, args, processes, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  errs = [p.communicate()[1] for p in procs]
  if any(p.returncode for p in procs):
    raise SystemExit(f"{command} {' '.join(args)} failed:\n" + "\n".join(e[-3000:] for e in errs))


def records(run_dir: str) -> dict[int, dict]:
  """Each step's last record (a resumed run's win)."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "step" in r}


def worst(a: str, b: str, key: str | None = None) -> float:
  """The largest difference of a metric (``key``, or every one but the timings) at the steps of both runs."""
  ra, rb = records(a), records(b)
  return max(abs(ra[s][k] - rb[s][k]) for s in ra.keys() & rb.keys() for k in ra[s]
             if (k == key if key else k not in TIMING and k != "step" and ra[s][k] is not None))


def step_time(run_dir: str) -> str:
  later = [r for s, r in records(run_dir).items() if s > 1]
  return f"{np.median([r['rollout_s'] for r in later]):.3f} + {np.median([r['train_s'] for r in later]):.3f}"


def base_run(runs: str) -> tuple[str, str]:
  """The starting run and the prompts file."""
  base, prompts = os.path.join(runs, "base"), os.path.join(runs, "prompts.jsonl")
  run("train.gpt", [*MODEL, "--optimizer", "adamw", "--steps", "2", "--global-batch-size", "8", "--mesh", "fs=1",
                    "--eval-tokens", "0", "--run-dir", base])
  with open(prompts, "w") as f:
    for a, b in [(1, 2), (40, 4), (12, 7), (5, 5), (9, 1)]:
      f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  return base, prompts


def processes_table(runs: str, base: str, prompts: str, meshes: list[str], optimizers: list[str], steps: int) -> list[str]:
  rows = ["| mesh | optimizer | worst metric difference | step s, 1 process (rollout + update) |"
          " step s, 2 processes |", "|---|---|---|---|---|"]
  for mesh in meshes:
    for optimizer in optimizers:
      args = ["--init-from", base, "--prompts", prompts, *GRPO, "--optimizer", optimizer, "--mesh", mesh,
              "--steps", str(steps)]
      name = f"{mesh}-{optimizer}".replace(",", "_").replace("=", "")
      one, two = os.path.join(runs, f"one-{name}"), os.path.join(runs, f"two-{name}")
      run("train.grpo", [*args, "--run-dir", one])
      run("train.grpo", [*args, "--run-dir", two], processes=2)
      rows.append(f"| {mesh} | {optimizer} | {worst(one, two):.1e} | {step_time(one)} | {step_time(two)} |")
      print(rows[-1], flush=True)
  return rows


def resume_table(runs: str, base: str, prompts: str, mesh: str, steps: int) -> list[str]:
  rows = ["| first half | second half | worst metric difference to the run that never stopped |", "|---|---|---|"]
  args = ["--init-from", base, "--prompts", prompts, *GRPO, "--optimizer", "dion", "--mesh", mesh]
  straight = os.path.join(runs, "straight")
  run("train.grpo", [*args, "--steps", str(steps), "--run-dir", straight])
  for first, second in ((2, 1), (1, 2)):
    run_dir = os.path.join(runs, f"resumed-{first}-{second}")
    run("train.grpo", [*args, "--steps", str(steps // 2), "--run-dir", run_dir], processes=first)
    run("train.grpo", ["--run-dir", run_dir, "--resume", "--steps", str(steps)], processes=second)
    rows.append(f"| {first} process(es) | {second} process(es) | {worst(straight, run_dir):.1e} |")
    print(rows[-1], flush=True)
  return rows


def death(command: str, args: list[str], run_dir: str, bare: bool) -> dict:
  """Process 0's process group killed once step 3 is logged: what process 1 did."""
  procs = start(command, [*args, "--run-dir", run_dir], 2, bare, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  metrics, whole = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "checkpoints", "2", "commit_success.txt")
  while not (os.path.exists(metrics) and 3 in records(run_dir) and os.path.exists(whole)):
    if any(p.poll() is not None for p in procs):
      raise SystemExit(f"ended early: {procs[0].communicate()[1].decode()[-3000:]}")
    time.sleep(0.05)
  os.set_blocking(procs[1].stderr.fileno(), False)
  procs[1].stderr.read()  # what process 1 wrote before the kill is not counted
  os.killpg(procs[0].pid, signal.SIGKILL)
  killed = time.monotonic()
  code = procs[1].wait()
  seconds = time.monotonic() - killed
  os.set_blocking(procs[1].stderr.fileno(), True)
  after = procs[1].stderr.read().decode(errors="replace")
  procs[0].wait()
  names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
  return {"code": code, "lines": after.count("\n"), "last": (after.strip().splitlines() or [""])[-1][:160],
          "seconds": seconds, "checkpoints": names, "lock": os.path.exists(os.path.join(run_dir, "run.lock"))}


def death_table(runs: str, base: str, prompts: str) -> list[str]:
  rows = ["| command | watched by | survivor's exit | lines after the kill | seconds to exit | checkpoints left"
          " | lock left | --resume on 1 process vs never stopped |", "|---|---|---|---|---|---|---|---|"]
  commands = {"train.gpt": (GPT, "loss"),
              "train.grpo": (["--init-from", base, "--prompts", prompts, *GRPO, "--optimizer", "adamw", "--mesh",
                              "fs=2,tp=2"], None)}
  for command, (args, key) in commands.items():
    straight = os.path.join(runs, f"straight-{command}")
    run(command, [*args, "--steps", "8", "--run-dir", straight])
    for bare in (True, False):
      run_dir = os.path.join(runs, f"death-{command}-{'bare' if bare else 'agent'}")
      seen = death(command, [*args, "--steps", "1000", "--heartbeat-timeout", "10"], run_dir, bare)
      if seen["lock"]:  # a dead process's lock: --resume takes it over
        os.remove(os.path.join(run_dir, "run.lock"))
      done = max(int(n) for n in seen["checkpoints"] if n.isdigit())
      run(command, ["--run-dir", run_dir, "--resume", "--steps", str(done + 2)])
      code = seen["code"] if seen["code"] >= 0 else f"{128 - seen['code']} ({signal.Signals(-seen['code']).name})"
      rows.append(f"| {command} | {'nothing (before)' if bare else 'its agent'} | {code} | {seen['lines']}"
                  f" | {seen['seconds']:.1f} | {', '.join(seen['checkpoints'])} | {'yes' if seen['lock'] else 'no'}"
                  f" | {worst(straight, run_dir, key):.1e} |")
      print(rows[-1], f"\n  last line: {seen['last']}", flush=True)
  return rows


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_processes", description=__doc__.split("\n\n")[0])
  harness.add_out(parser, "benchmarks/results/grpo_processes.md", "the markdown table")
  parser.add_argument("--runs", default="runs/grpo_processes")
  parser.add_argument("--meshes", nargs="+", default=["rp=2,fs=2", "fs=2,tp=2", "fs=4"])
  parser.add_argument("--optimizers", nargs="+", default=["dion", "adamw"])
  parser.add_argument("--steps", type=int, default=6)
  args = parser.parse_args(argv)
  shutil.rmtree(args.runs, ignore_errors=True)
  os.makedirs(args.runs)
  base, prompts = base_run(args.runs)
  lines = [f"# Multi-process GRPO and process 0's death (`python -m benchmarks.grpo_processes`)", "",
           f"{os.cpu_count()} CPU cores; {args.steps} GRPO steps of 2 prompts x 4 completions, KL on.", "",
           "## Two processes against one (4 CPU devices)", "",
           *processes_table(args.runs, base, prompts, args.meshes, args.optimizers, args.steps), "",
           "## Resumed on another process count (Dion, rp=2,fs=2)", "",
           *resume_table(args.runs, base, prompts, "rp=2,fs=2", args.steps), "",
           "## Process 0 killed with its process group after step 3 (step 2 saved)", "",
           *death_table(args.runs, base, prompts), "", NOTE, ""]
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
