"""The planner's memory against the trainer's compiled step, per mesh kind and recompute
policy: ``python -m benchmarks.plan_memory`` prints a Markdown table (planned device total,
compiled arguments + outputs - aliased + temporaries, their ratio, and the planned parts),
the numbers ``docs/planning.md`` quotes; ``tests/test_train_run_plan_memory.py`` holds the bound.

    python -m benchmarks.plan_memory                      # tiny, every mesh kind and policy
    python -m benchmarks.plan_memory --case "--preset small --mesh fs=8"   # one case (heavy)
    python -m benchmarks.plan_memory --gpu-json gpu-evidence/DEVICE/gpu.json

``--gpu-json`` compiles nothing: it sets the planner's device and host memory beside each
row of ``python -m train.gpu``'s memory stage (a GPU's compiled step, where offloaded
tensors are in host memory, as XLA:CPU's are not).
"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.harness import setup_process
from train.run.plan import compiled as plan_compiled
from train.run.plan.planner import size
from train.run import compiled as compiled_lib

TINY = "--preset tiny --global-batch-size 8 --vocab-size 2048"
DION = "--optimizer dion --dion-rank-fraction 0.25"  # tiny's default rank is 1: whole matrices, not a scale's
CASES = [
    f"{TINY} --mesh fs=8 --optimizer adamw",
    f"{TINY} --mesh fs=8 --optimizer adamw --remat full",
    f"{TINY} --mesh fs=4,tp=2 --optimizer adamw",
    f"{TINY} --mesh fs=8 --optimizer dion",
    f"{TINY} --mesh fs=2,tp=4 --optimizer dion",
    f"{TINY} --mesh fs=4,tp=2 {DION} --remat selective",
    f"{TINY} --mesh rp=2,fs=2,tp=2 {DION}",
    f"{TINY} --mesh rp=8 {DION} --remat save_out_proj --global-batch-size 16 --micro-batch-size 1",
    f"{TINY} --mesh rp=2,fs=2,tp=2 {DION} --remat selective --micro-batch-size 1",
    f"{TINY} --mesh fs=4,tp=2 --optimizer adamw --micro-batch-size 1",
    f"{TINY} --mesh fs=2,cp=2,tp=2 --remat save_dot_except_mlp --optimizer muon",
    f"{TINY} --mesh pp=2,fs=2,tp=2 --remat full {DION}",
    f"{TINY} --mesh pp=2,fs=2,tp=2 --optimizer adamw",
    f"{TINY} --mesh fs=8 --optimizer adamw --remat minimal_offloaded --loss-chunk 32",
    f"{TINY} --mesh fs=8 --optimizer adamw --remat qkv_proj_offloaded",
    f"{TINY} --mesh fs=4,tp=2 --optimizer adamw --offload-optimizer",
    "--preset tiny-moe --global-batch-size 8 --vocab-size 2048 --mesh ep=2,fs=2,tp=2 --optimizer adamw"
    " --remat save_qkv_proj",
    f"--preset tiny-moe --global-batch-size 8 --vocab-size 2048 --mesh ep=2,fs=4 {DION}",
]


def row(case: str) -> str:
  argv = case.split()
  t0 = time.perf_counter()
  step = compiled_lib.compile_step(argv)
  got = compiled_lib.footprint(step.compiled.memory_analysis())
  plan = plan_compiled.planned(argv)
  # On CPU what is offloaded stays on the device (models/remat.py).
  planned = plan["device_total"] + plan["host_total"]
  parts = ", ".join(f"{k} {size(v)}" for k, v in plan["device"].items() if v)
  return (f"| `{case}` | {size(planned)} | {size(got.device)} | {planned / got.device:.3f} | {size(got.host)}"
          f" | {parts} | {time.perf_counter() - t0:.0f} s |")


def gpu_rows(path: str) -> list[str]:
  """The planner beside each row of a GPU run's memory stage (``train/gpu/memory.py``)."""
  with open(path) as f:
    stage = json.load(f)["memory"]
  lines = ["| flags | planned device | GPU device | ratio | planned host | GPU host | ms/step |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in stage["rows"]:
    if "error" in r:
      lines.append(f"| `{r['flags']}` | | {r['error'][:80]} | | | | |")
      continue
    plan = plan_compiled.planned(r["flags"].split())
    device, host = r["device_GiB"] * 2**30, r["host_GiB"] * 2**30
    lines.append(f"| `{r['flags']}` | {size(plan['device_total'])} | {size(device)}"
                 f" | {plan['device_total'] / device:.3f} | {size(plan['host_total'])} | {size(host)}"
                 f" | {r.get('ms_per_step', float('nan')):.1f} |")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_memory",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--case", action="append", help="train.gpt flags of one case (repeatable); default: CASES")
  parser.add_argument("--gpu-json", help="python -m train.gpu's gpu.json: the planner beside its memory stage's rows")
  args = parser.parse_args()
  setup_process(8, "cpu")  # before JAX's backend starts; importing this module starts none
  if args.gpu_json:
    print("\n".join(gpu_rows(args.gpu_json)))
    return
  print("| flags | planned device | compiled device | ratio | compiled host | planned parts | compile |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for case in args.case or CASES:
    print(row(case), flush=True)


if __name__ == "__main__":
  main()
