"""Muon, NorMuon and Dion2 as whole optimizers, on the skeleton of :func:`dion_jax.dion`.

Each is :func:`dion_jax.optimizer.matrix_optimizer` around
:func:`dion_jax.family.scale_by_orthogonal`: ``"dion"``-labelled matrices get

    X ← X − lr·wd·X − lr·scale(fan_out, fan_in)·U

(weight decay with the base lr, optionally cautious), every other leaf the scalar
optimizer (AdamW or Lion, the LM head's lr scaled), exactly as with Dion. Their
defaults are microsoft/dion's: lr 0.01, weight decay 0.01, Polar Express in bf16,
``scale_rule="fan_ratio"`` (the reference's ``adjust_lr="spectral_norm"``).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from dion_jax import family
from dion_jax import optimizer


# Structural arguments of each optimizer, for optax.inject_hyperparams (as dion_jax.STATIC_ARGS).
_STATIC = ("labels", "scale_rule", "dimension_numbers", "momentum_dtype", "ortho_dtype", "ortho_method",
           "lm_head_lr_scale", "cautious_wd")  # fmt: skip
MUON_STATIC_ARGS = _STATIC + ("nesterov", "num_heads")
NORMUON_STATIC_ARGS = MUON_STATIC_ARGS
DION2_STATIC_ARGS = _STATIC + ("fraction", "selection_scope")

_DIRECTION_ARGS = ("epsilon", "ortho_method", "ortho_dtype", "scale_rule", "momentum_dtype",
                   "partition_specs", "mesh", "replicate_sync", "backend")  # fmt: skip


def _family_optimizer(algorithm, learning_rate, matrix_kw, common) -> optax.GradientTransformation:
  """``matrix_optimizer`` around ``scale_by_orthogonal(algorithm)``; ``common`` holds the
  caller's other arguments (the skeleton's and the transformation's)."""
  direction_kw = {k: common.pop(k) for k in _DIRECTION_ARGS}
  direction = family.scale_by_orthogonal(
      algorithm, dimension_numbers=common["dimension_numbers"], **matrix_kw, **direction_kw
  )
  return optimizer.matrix_optimizer(direction, learning_rate, mu=matrix_kw.get("mu", 0.95), **common)


_COMMON_DOC = """
    weight_decay, cautious_wd, scalar_optimizer, scalar_learning_rate, b1, b2,
      scalar_epsilon, lm_head_lr_scale, labels: as for :func:`dion_jax.dion`.
    epsilon, ortho_method, ortho_dtype, scale_rule, momentum_dtype, dimension_numbers,
      partition_specs, mesh, replicate_sync, backend: see
      :func:`dion_jax.family.scale_by_orthogonal`.
"""


def muon(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    mu: float = 0.95,
    nesterov: bool = False,
    num_heads=None,
    weight_decay: float = 0.01,
    cautious_wd: bool = False,
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = jnp.bfloat16,
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
) -> optax.GradientTransformation:
  """Muon (Keller Jordan) for matrices, AdamW or Lion for everything else.

  ``M ← mu·M + G``; the update is the polar factor of M (of ``mu·M + G`` with
  ``nesterov``), orthogonalized whole, one device per matrix on a mesh.

  Args:
    learning_rate: base learning rate, a float or an optax schedule.
    mu, nesterov: momentum.
    num_heads: orthogonalize each head of the fan_out axis on its own (an int, a
      pytree of ints/None matching the parameters, or a callable).
  """ + _COMMON_DOC
  matrix_kw = dict(mu=mu, nesterov=nesterov, num_heads=num_heads)
  return _family_optimizer("muon", learning_rate, matrix_kw, _common(locals()))


def normuon(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    mu: float = 0.95,
    muon_beta2: float = 0.95,
    nesterov: bool = False,
    num_heads=None,
    weight_decay: float = 0.01,
    cautious_wd: bool = False,
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = jnp.bfloat16,
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
  """ + _COMMON_DOC
  matrix_kw = dict(mu=mu, muon_beta2=muon_beta2, nesterov=nesterov, num_heads=num_heads)
  return _family_optimizer("normuon", learning_rate, matrix_kw, _common(locals()))


def dion2(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    fraction: float = 0.25,
    ef_decay: float = 0.95,
    selection_scope: str = "local",
    weight_decay: float = 0.01,
    cautious_wd: bool = False,
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = jnp.bfloat16,
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
) -> optax.GradientTransformation:
  """Dion2 (arXiv 2512.16928) for matrices, AdamW or Lion for everything else.

  ``M ← M + G``; the ceil(fraction·s) rows or columns (the shorter side, of length s)
  of M with the largest L1 norms are orthogonalized as one submatrix, scaled in M by
  ``ef_decay``, and only they are updated (all weights decay).

  Args:
    learning_rate: base learning rate, a float or an optax schedule.
    fraction: the selected fraction of the shorter side, in (0, 1].
    ef_decay: error-feedback decay of the selected slices of M.
    selection_scope: on a mesh that shards the selection axis, ``"local"`` (each shard
      selects its own top slices and sends only them) or ``"global"`` (the exact top-k
      of the whole matrix, the same on every mesh).
  """ + _COMMON_DOC
  matrix_kw = dict(fraction=fraction, ef_decay=ef_decay, selection_scope=selection_scope)
  return _family_optimizer("dion2", learning_rate, matrix_kw, _common(locals()))


_MATRIX_ARGS = ("learning_rate", "mu", "nesterov", "num_heads", "muon_beta2", "fraction", "ef_decay",
                "selection_scope", "matrix_kw")  # fmt: skip


def _common(arguments: dict) -> dict:
  return {k: v for k, v in arguments.items() if k not in _MATRIX_ARGS}
