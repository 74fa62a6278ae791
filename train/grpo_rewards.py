"""GRPO's rewards: the two built in for a verifiable task (an answer after ``####``,
GSM8K's marker, and the format), ``module:function`` rewards named on the command line,
and scoring a rollout's completions with them (``python -m train.grpo --reward``).

A reward is called as ``function(prompts=[...], completions=[...], **columns)`` with one
list entry per completion (TRL's convention: the row's columns repeated for each of its
completions) and returns one finite float per completion.
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable

import numpy as np

from train.cli import UsageError

MARKER = "####"


def answer_reward(prompts: list[str], completions: list[str], answer: list[Any], **_) -> list[float]:
  """1 where the text after the completion's last ``####`` is the row's answer, else 0."""
  del prompts
  return [float(MARKER in c and c.rsplit(MARKER, 1)[1].strip() == str(a).strip())
          for c, a in zip(completions, answer)]


def format_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
  """1 where the completion ends with ``####`` and a non-empty answer, else 0."""
  del prompts
  return [float(re.search(re.escape(MARKER) + r"[ \t]*\S[^\n]*\s*$", c) is not None) for c in completions]


BUILTIN_REWARDS = {"answer": answer_reward, "format": format_reward}


def reward_functions(specs: list[str]) -> list[tuple[str, Callable, float]]:
  """``(name, function, weight)`` of each ``NAME[=WEIGHT]``."""
  out = []
  for spec in specs:
    name, _, weight = spec.partition("=")
    try:
      weight = float(weight) if weight else 1.0
    except ValueError:
      raise UsageError(f"--reward {spec}: the weight after '=' must be a number") from None
    if name in BUILTIN_REWARDS:
      out.append((name, BUILTIN_REWARDS[name], weight))
      continue
    module, _, function = name.partition(":")
    if not module or not function:
      raise UsageError(f"--reward {spec}: name a built-in ({', '.join(BUILTIN_REWARDS)}) or"
                       " module:function")
    try:
      fn = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
      raise UsageError(f"--reward {spec}: cannot load {name} ({e}); pass an importable module:function") from None
    out.append((name, fn, weight))
  return out


def score(rewards: list[tuple[str, Callable, float]], rows: list[dict], prompts: list[str], completions: list[str], group: int) -> np.ndarray:
  """Rewards [B, R] of the completions (rows repeated ``group`` times)."""
  columns = {key: [row.get(key) for row in rows for _ in range(group)] for key in {k for r in rows for k in r}}
  columns.pop("prompt", None)
  out = []
  for name, fn, _ in rewards:
    try:
      values = np.asarray(fn(prompts=prompts, completions=completions, **columns), np.float64)
    except Exception as e:  # a user's function: whatever it raises is its bad input
      raise UsageError(f"--reward {name} raised {type(e).__name__}: {e}") from None
    if values.shape != (len(completions),) or not np.all(np.isfinite(values)):
      raise UsageError(f"--reward {name} must return one finite number per completion; got"
                       f" {values.shape[0] if values.ndim else values} values with"
                       f" {int(np.sum(~np.isfinite(values)))} not finite")
    out.append(values)
  return np.stack(out, 1)
