"""Checks of hyper-parameters: one error line that names the argument and what it accepts.

Numbers are checked against one table of rules; arrays (``optax.inject_hyperparams``
passes them), schedules and None pass, so a schedule can replace any number. Choices
(strings) are checked against the tuple their owner defines. Structural arguments (a
rank, a fraction, a dtype: they fix shapes) must not be arrays (:func:`check_static`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

# name: (rule, what it must be)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rank_fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "rank_multiple_of": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "power_iters": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "cqr_warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "oversample": (lambda v: v >= 1, "a number >= 1"),
    "mu": (lambda v: v >= 0, "a number >= 0"),
    "ef_decay": (lambda v: v >= 0, "a number >= 0"),
    "epsilon": (lambda v: v >= 0, "a number >= 0"),
    "weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "scalar_weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "muon_beta2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "b1": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "learning_rate": (lambda v: v >= 0, "a number >= 0 or an optax schedule"),
    "scalar_learning_rate": (lambda v: v >= 0, "a number >= 0, an optax schedule or None"),
    "lm_head_lr_scale": (lambda v: v > 0, "a number > 0 or None"),
}


def is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_numbers(**values: Any) -> None:
  """Raises ValueError naming the first number that breaks its rule in ``_RULES``."""
  for name, value in values.items():
    ok, accepted = _RULES[name]
    if is_number(value) and not ok(value):
      raise ValueError(f"{name}={value!r} is invalid; it must be {accepted}")


def check_choice(name: str, value: Any, accepted: Sequence[Any]) -> None:
  """Raises ValueError when ``value`` is not one of ``accepted``."""
  if value not in accepted:
    raise ValueError(f"{name}={value!r} is not supported; use one of {tuple(accepted)}")


def check_static(static_args: str, **values: Any) -> None:
  """Raises ValueError when one of ``values``, arguments that fix shapes, is an array:
  ``optax.inject_hyperparams`` makes arrays of the numbers (and calls the callables) it
  is not told are static, and a traced array cannot fix a shape."""
  for name, value in values.items():
    if isinstance(value, (jax.Array, np.ndarray)):
      raise ValueError(f"{name} arrived as an array (optax.inject_hyperparams makes arrays of numbers and"
                       f" schedules of callables); it fixes shapes: pass static_args=dion_jax.{static_args}")
