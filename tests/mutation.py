"""Mutation check, run by hand before a release (not collected by pytest):

    python tests/mutation.py                   # every mutant against this tree's tests
    python tests/mutation.py --tests-from main # the same mutants against main's tests/
    python tests/mutation.py -k schedule       # only mutants whose name contains "schedule"

Each mutant is a small, realistic one-line bug. For each, the script copies the tree to a
temporary directory, applies the edit there (the tree itself is never touched), runs the
tests named for it, and counts the mutant caught when they fail. It prints one line per
mutant and the score. A missed mutant needs a test, or its named tests are the wrong ones.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_FLOAT64 = "tests/test_models_gpt.py::test_loss_matches_float64_numpy"
SCHEDULE = "tests/test_train_run_optim.py::test_schedule_is_megatrons"
ROUTER_GRADIENT = "tests/test_models_moe.py::test_router_losses_reach_the_router_gradient"


class Mutant(NamedTuple):
  name: str
  path: str
  old: str  # must occur exactly once in path
  new: str
  tests: tuple[str, ...]  # pytest node ids that should fail


MUTANTS = [
    Mutant("warmup starts at zero", "train/run/optim.py",
           "optax.linear_schedule(lr / warmup, lr, warmup - 1)", "optax.linear_schedule(0.0, lr, warmup)",
           (SCHEDULE,)),
    Mutant("cosine ignores --min-lr", "train/run/optim.py", "alpha=end / lr", "alpha=0.0", (SCHEDULE,)),
    Mutant("linear decay ignores --min-lr", "train/run/optim.py", "optax.linear_schedule(lr, end, decay)",
           "optax.linear_schedule(lr, 0.0, decay)", (SCHEDULE,)),
    Mutant("wsd anneal default from decay minus warmup", "train/run/optim.py", "max(cfg.decay_steps // 5, 1)",
           "max(decay // 5, 1)", ("tests/test_train_run_optim.py::test_schedule_defaults_warmup_and_wsd_decay",)),
    Mutant("default warmup 10% instead of 5%", "train/run/config.py", "self.decay_steps // 20 if",
           "self.decay_steps // 10 if", ("tests/test_train_run_optim.py::test_schedule_defaults_warmup_and_wsd_decay",)),
    Mutant("--weight-decay on embeddings/LM head/norms (AdamW)", "train/run/optim.py",
           '"scalar": cfg.scalar_weight_decay}', '"scalar": cfg.weight_decay}',
           ("tests/test_train_run_optim.py::test_weight_decay_groups_after_one_step",)),
    Mutant("--weight-decay on embeddings/LM head/norms (Dion)", "train/run/optim.py",
           "scalar_weight_decay=cfg.scalar_weight_decay)", "scalar_weight_decay=cfg.weight_decay)",
           ("tests/test_train_run_optim.py::test_weight_decay_groups_after_one_step",)),
    Mutant("RMSNorm epsilon 10x", "models/config.py", "norm_eps: float = FLOAT32_EPS",
           "norm_eps: float = 10 * FLOAT32_EPS", (GPT_FLOAT64,)),
    Mutant("rotary base 10x", "models/config.py", "rope_base: float = 10000.0", "rope_base: float = 100000.0",
           (GPT_FLOAT64,)),
    Mutant("residual stream rounded to bf16 after every layer", "models/gpt.py",
           'return x_BxTxD + par.constrain(mlp.astype(jnp.float32), "batch", "seq", None), aux',
           'return (x_BxTxD + par.constrain(mlp.astype(jnp.float32), "batch", "seq", None))'
           '.astype(jnp.bfloat16).astype(jnp.float32), aux',
           ("tests/test_models_gpt.py::test_bfloat16_layers_keep_a_float32_residual_stream", GPT_FLOAT64)),
    Mutant("clipping uses twice the norm", "train/run/step.py",
           "clip_grad / jnp.maximum(norm, 1e-30)", "clip_grad / jnp.maximum(2 * norm, 1e-30)",
           ("tests/test_train_run_step.py::test_gradient_clipping_against_the_float64_norm",)),
    Mutant("scalar AdamW's beta2 0.999", "train/run/optim.py", "B1, B2 = 0.9, 0.95", "B1, B2 = 0.9, 0.999",
           ("tests/test_train_run_optim.py::test_adamw_is_the_published_recipe",)),
    Mutant("balance loss without gradient", "models/moe.py", "probs_BxE = _over_cp(probs_BxTxE.sum(1))",
           "probs_BxE = jax.lax.stop_gradient(_over_cp(probs_BxTxE.sum(1)))",
           ("tests/test_models_moe.py::test_balance_loss_spreads_a_skewed_router", ROUTER_GRADIENT)),
    Mutant("z-loss without gradient", "models/moe.py", "jnp.square(jax.nn.logsumexp(logits_BxTxE, -1))",
           "jnp.square(jax.lax.stop_gradient(jax.nn.logsumexp(logits_BxTxE, -1)))", (ROUTER_GRADIENT,)),
]


def run_tests(tree: str, tests: tuple[str, ...], timeout: int) -> str:
  """'caught', 'missed', or why the tests did not run."""
  present = [t for t in tests if os.path.exists(os.path.join(tree, t.split("::")[0]))]
  if not present:
    return "missed (no such test)"
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *present]
  try:
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return "timeout"
  if proc.returncode == 1:
    return "caught"
  if proc.returncode == 0:
    return "missed"
  if proc.returncode in (4, 5):  # a named test does not exist (e.g. in --tests-from's tests/)
    return "missed (no such test)"
  return f"error (pytest exit {proc.returncode})"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("-k", default="", help="only mutants whose name contains this")
  parser.add_argument("--tests-from", metavar="REV", help="use tests/ of this git revision")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant (default 900)")
  args = parser.parse_args(argv)
  mutants = [m for m in MUTANTS if args.k in m.name]
  with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
    tree = os.path.join(tmp, "tree")
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache"))
    if args.tests_from:
      shutil.rmtree(os.path.join(tree, "tests"))
      archive = subprocess.run(["git", "archive", args.tests_from, "tests"], cwd=ROOT, check=True,
                               capture_output=True).stdout
      subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    caught = 0
    for m in mutants:
      path = os.path.join(tree, m.path)
      with open(path) as f:
        source = f.read()
      if source.count(m.old) != 1:
        print(f"error: mutant {m.name!r}: {m.path} does not hold its line exactly once; update MUTANTS",
              file=sys.stderr)
        return 2
      with open(path, "w") as f:
        f.write(source.replace(m.old, m.new))
      try:
        outcome = run_tests(tree, m.tests, args.timeout)
      finally:
        with open(path, "w") as f:
          f.write(source)
      caught += outcome == "caught"
      print(f"{outcome:>10}  {m.name}  ({', '.join(m.tests)})", flush=True)
  print(f"score: {caught}/{len(mutants)} mutants caught")
  return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
  sys.exit(main())
