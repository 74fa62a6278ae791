"""``python -m train.gpu``'s memory stage on CPU (tiny, two policies), so that its code runs
before a GPU's minutes are spent on it: each row's compiled memory and a timed step, against
the same flags' step compiled alone, and the planner set beside the rows as
``benchmarks/plan_memory.py --gpu-json`` does."""
import argparse
import json

from benchmarks import plan_memory
from train.gpu import memory as gpu_memory
from train.run import compiled as compiled_lib

EXTRA = ("--vocab-size", "512", "--optimizer", "adamw", "--num-layers", "2", "--seq-len", "64")


def test_memory_stage_reports_each_policy_s_compiled_memory(tmp_path):
  args = argparse.Namespace(stage_seconds=float("inf"), train_steps=1)
  out = gpu_memory.stage_memory(args, runs=(("tiny", 8),), policies=("none", "full"), offloads=(False,), extra=EXTRA)
  rows = {r["policy"]: r for r in out["rows"]}
  assert set(rows) == {"none", "full"} and not any("error" in r for r in out["rows"])
  # Recomputing everything keeps less than keeping every product.
  assert rows["full"]["device_GiB"] < rows["none"]["device_GiB"]
  assert all(r["ms_per_step"] > 0 for r in rows.values()) and rows["full"]["time_over_none"] > 0
  # The stage's figure is the step's own memory_analysis() (compiled again here, alone).
  alone = compiled_lib.footprint(compiled_lib.compile_step(rows["full"]["flags"].split()).compiled.memory_analysis())
  assert rows["full"]["device_GiB"] * 2**30 == alone.device
  assert gpu_memory.markdown(out).count("\n") == 1 + len(out["rows"])
  path = tmp_path / "gpu.json"
  path.write_text(json.dumps({"memory": out}))
  table = plan_memory.gpu_rows(str(path))
  assert len(table) == 2 + len(out["rows"])
  # The planner's bound (tests/test_train_run_plan_memory.py's); one CPU device, 2 layers of 64
  # tokens: 0.98 (none) and 1.04 (full) achieved.
  ratios = [float(line.split(" | ")[3]) for line in table[2:]]
  assert all(0.9 <= r <= 1.25 for r in ratios), table
