"""``python -m train.gpu``'s memory stage on CPU (tiny, two policies), so that its code runs
before a GPU's minutes are spent on it: each row's compiled memory, the planner's beside it,
and a timed step."""
import argparse

from train.gpu import memory as gpu_memory


def test_memory_stage_reports_each_policy_s_compiled_and_planned_memory():
  args = argparse.Namespace(stage_seconds=float("inf"), train_steps=1)
  out = gpu_memory.stage_memory(args, runs=(("tiny", 8),), policies=("none", "full"), offloads=(False,),
                                extra=("--vocab-size", "512", "--optimizer", "adamw", "--num-layers", "2",
                                       "--seq-len", "64"))
  rows = {r["policy"]: r for r in out["rows"] if not r["offload_optimizer"]}
  assert set(rows) == {"none", "full"} and not any("error" in r for r in out["rows"])
  # The compiled step's own memory: recomputing everything keeps less than keeping every product.
  assert rows["full"]["device_GiB"] < rows["none"]["device_GiB"]
  for r in rows.values():
    # The stage reports the planner's ratio (its bound is tests/test_train_plan_memory.py's);
    # here, one CPU device, 2 layers of 64 tokens: 0.98 (none) and 1.04 (full) achieved.
    assert 0.9 <= r["ratio"] <= 1.25 and r["ms_per_step"] > 0, r
  assert rows["full"]["time_over_none"] > 0
  assert gpu_memory.markdown(out).count("\n") == 1 + len(out["rows"])
