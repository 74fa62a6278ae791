"""GRPO's rewards: the two built in for a verifiable task (an answer after ``####``,
GSM8K's marker, and the format), ``module:function`` rewards named on the command line,
and scoring a rollout's completions with them (``python -m train.grpo --reward``).

A reward is called as ``function(prompts=[...], completions=[...], **columns)`` with one
list entry per completion (TRL's convention: the row's columns repeated for each of its
completions) and returns one finite float per completion.
"""
from __future__ import annotations

import functools
import importlib
import re
from typing import Callable

import numpy as np

from train.cli import UsageError

MARKER = "####"
_NUMBER = re.compile(r"-?[0-9.,]+")


def final_answer(text: str) -> str:
  """The answer a text gives: what follows its last ``####`` (all of it without one), its
  first line, the number it starts with when it starts with one, without commas and a
  trailing period (GSM8K's evaluation: ``#### 1,234.`` is ``1234``)."""
  after = text.rsplit(MARKER, 1)[-1].strip().split("\n", 1)[0].strip()
  number = _NUMBER.match(after)
  answer = (number.group() if number else after).replace(",", "")
  return answer[:-1] if answer.endswith(".") else answer


def answer_reward(prompts: list[str], completions: list[str], column: str = "answer", **columns) -> list[float]:
  """1 where the completion's answer after its last ``####`` is the row's ``column``'s
  (:func:`final_answer` of each: a GSM8K answer's reasoning and marker are dropped), else 0."""
  del prompts
  return [float(MARKER in c and final_answer(c) == final_answer(str(a)))
          for c, a in zip(completions, columns[column])]


def format_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
  """1 where the completion ends with ``####`` and a non-empty answer, else 0."""
  del prompts
  return [float(re.search(re.escape(MARKER) + r"[ \t]*\S[^\n]*\s*$", c) is not None) for c in completions]


BUILTIN_REWARDS = {"answer": answer_reward, "format": format_reward}


def reward_functions(specs: list[str], answer_column: str = "answer") -> list[tuple[str, Callable, float]]:
  """``(name, function, weight)`` of each ``NAME[=WEIGHT]``; the built-in answer reward
  reads ``answer_column``."""
  out = []
  for spec in specs:
    name, _, weight = spec.partition("=")
    try:
      weight = float(weight) if weight else 1.0
    except ValueError:
      raise UsageError(f"--reward {spec}: the weight after '=' must be a number") from None
    if name in BUILTIN_REWARDS:
      fn = BUILTIN_REWARDS[name]
      out.append((name, functools.partial(fn, column=answer_column) if fn is answer_reward else fn, weight))
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


def score(rewards: list[tuple[str, Callable, float]], rows: list[dict], prompts: list[str], completions: list[str]
          ) -> np.ndarray:
  """Rewards [B, R] of the completions, ``rows`` the prompts' rows, one per completion (a
  prompt's row repeated for each of its completions). No completions: no call, [0, R]."""
  if not completions:
    return np.zeros((0, len(rewards)))
  columns = {key: [row.get(key) for row in rows] for key in {k for r in rows for k in r}}
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
