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
  return planner.plan(model_cfg, cfg.mesh or f"fs={len(jax.devices())}", cfg.optimizer,
                      rank_fraction=cfg.dion_rank_fraction, global_batch=cfg.global_batch_size,
                      micro=cfg.micro_batch_size, dtype=model_cfg.dtype, compare=False, remat=model_cfg.remat,
                      offload_optimizer=getattr(cfg, "offload_optimizer", False),
                      loss_chunk=model_cfg.loss_chunk, split_q=cfg.dion_split_q)["memory"]
