"""The planner's memory for the trainer's own flags, beside the step
``train.run.compiled`` compiles for them: the pair ``tests/test_train_run_plan_memory.py`` and
``benchmarks/plan_memory.py`` compare."""
from __future__ import annotations

import jax

from train.run.plan import planner
from train.run.compiled import configs


def planned(argv: list[str], vocab_size: int = 50257) -> dict:
  """The planner's memory (``train.run.plan.memory.memory``) of the step
  ``train.run.compiled.compile_step`` compiles for the same flags."""
  cfg, model_cfg = configs(argv, vocab_size)
  return planner.plan_run(cfg, model_cfg, cfg.mesh or f"fs={len(jax.devices())}")["memory"]
