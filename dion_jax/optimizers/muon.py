"""Muon and NorMuon as whole optimizers, on the skeleton of :func:`dion_jax.dion`.

Each is :func:`dion_jax.matrix_optimizer` around :func:`dion_jax.scale_by_orthogonal`:
``"dion"``-labelled matrices get

    X ← X − lr·wd·X − lr·scale(fan_out, fan_in)·U

(weight decay with the base lr, optionally cautious), every other leaf the scalar
optimizer (AdamW or Lion, the LM head's lr scaled), exactly as with Dion. Their
defaults are microsoft/dion's: lr 0.01, weight decay 0.01, Polar Express in bf16,
``scale_rule="fan_ratio"`` (the reference's ``adjust_lr="spectral_norm"``). Their
keyword signatures are spelled out, as ``optax.inject_hyperparams`` binds them.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from dion_jax.optimizers.orthogonal import COMMON_DOC, STATIC_ARGS, orthogonal_optimizer

MUON_STATIC_ARGS = STATIC_ARGS + ("nesterov", "num_heads")
NORMUON_STATIC_ARGS = MUON_STATIC_ARGS


def muon(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    mu: float = 0.95,
    nesterov: bool = False,
    num_heads=None,
    weight_decay: float = 0.01,
    scalar_weight_decay: float | None = None,
    cautious_wd: bool = False,
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = "bfloat16",
    gram_newton_schulz: bool = False,
    scale_rule: str | Callable[[int, int], float] | None = "fan_ratio",
    momentum_dtype: Any = None,
    scalar_optimizer: str = "adamw",
    scalar_learning_rate: optax.ScalarOrSchedule | None = None,
    b1: float = 0.9,
    b2: float = 0.95,
    scalar_epsilon: float = 1e-8,
    lm_head_lr_scale: float | None = None,
    labels: Any = None,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
    megabatch_bytes: int | None = None,
) -> optax.GradientTransformation:
  """Muon (Keller Jordan) for matrices, AdamW or Lion for everything else.

  ``M ← mu·M + G``; the update is the polar factor of M (of ``mu·M + G`` with
  ``nesterov``), orthogonalized whole, one device per matrix on a mesh.

  Args:
    learning_rate: base learning rate, a float or an optax schedule.
    mu, nesterov: momentum.
    num_heads: orthogonalize each head of the fan_out axis on its own (an int, a
      pytree of ints/None matching the parameters, or a callable).
  """
  return orthogonal_optimizer("muon", locals())


def normuon(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    mu: float = 0.95,
    muon_beta2: float = 0.95,
    nesterov: bool = False,
    num_heads=None,
    weight_decay: float = 0.01,
    scalar_weight_decay: float | None = None,
    cautious_wd: bool = False,
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = "bfloat16",
    gram_newton_schulz: bool = False,
    scale_rule: str | Callable[[int, int], float] | None = "fan_ratio",
    momentum_dtype: Any = None,
    scalar_optimizer: str = "adamw",
    scalar_learning_rate: optax.ScalarOrSchedule | None = None,
    b1: float = 0.9,
    b2: float = 0.95,
    scalar_epsilon: float = 1e-8,
    lm_head_lr_scale: float | None = None,
    labels: Any = None,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
    megabatch_bytes: int | None = None,
) -> optax.GradientTransformation:
  """NorMuon (arXiv 2510.05491) for matrices, AdamW or Lion for everything else.

  Muon's polar factor U, then each output neuron's row divided by the square root of
  its second moment (an EMA with ``muon_beta2`` of the row's mean U²), rescaled to
  U's Frobenius norm.

  Args:
    learning_rate: base learning rate, a float or an optax schedule.
    mu, nesterov: momentum.
    muon_beta2: decay of the per-neuron second moment.
    num_heads: as for :func:`muon`.
  """
  return orthogonal_optimizer("normuon", locals())


muon.__doc__ += COMMON_DOC
normuon.__doc__ += COMMON_DOC
