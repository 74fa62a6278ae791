"""Dion2 (arXiv 2512.16928) and NorDion2 as whole optimizers, on the skeleton of
:func:`dion_jax.dion`.

Each is :func:`dion_jax.matrix_optimizer` around ``scale_by_orthogonal("dion2")`` or
``("nordion2")``, with microsoft/dion's defaults; the keyword signatures are spelled
out, as ``optax.inject_hyperparams`` binds them. ``dion3`` is ``nordion2`` under the
name microsoft/dion exports it as (``Dion3``).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from dion_jax.optimizers.orthogonal import COMMON_DOC, STATIC_ARGS, orthogonal_optimizer

DION2_STATIC_ARGS = STATIC_ARGS + ("fraction", "selection_scope")
NORDION2_STATIC_ARGS = DION2_STATIC_ARGS + ("num_heads",)


def dion2(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    fraction: float | None = None,
    ef_decay: float = 0.95,
    selection_scope: str = "local",
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
  """Dion2 (arXiv 2512.16928) for matrices, AdamW or Lion for everything else.

  ``M ← M + G``; the ceil(fraction·s) rows or columns (the shorter side, of length s)
  of M with the largest L1 norms are orthogonalized as one submatrix, scaled in M by
  ``ef_decay``, and only they are updated (all weights decay).

  Args:
    learning_rate: base learning rate, a float or an optax schedule.
    fraction: the selected fraction of the shorter side, in (0, 1] (None: 1/4).
    ef_decay: error-feedback decay of the selected slices of M.
    selection_scope: on a mesh that shards the selection axis, ``"local"`` (each shard
      selects its own top slices and sends only them) or ``"global"`` (the exact top-k
      of the whole matrix, the same on every mesh). microsoft/dion's third scope,
      ``"global_capped"`` (each shard sends its share of the global top-k, up to its
      local count, then its next-best slices), selects exactly ``"local"``'s slices:
      a shard's share of the global top-k is its own largest slices.
  """
  return orthogonal_optimizer("dion2", locals())


dion2.__doc__ += COMMON_DOC


def nordion2(
    learning_rate: optax.ScalarOrSchedule = 0.01,
    *,
    fraction: float | None = None,
    mu: float = 0.95,
    muon_beta2: float = 0.95,
    selection_scope: str = "global",
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
  """NorDion2 (microsoft/dion's ``NorDion2``, exported as ``Dion3``) for matrices,
  AdamW or Lion for everything else.

  Dion2's selection, always of output neurons, then NorMuon's normalization of the
  selected ones. With M (fan_out x fan_in) and v (one per neuron), both zero at first:
  ``M ← M + G``; the k = ceil(fraction·fan_out) neurons S of M with the largest L1
  norms give ``O = polar(M_S)``; ``M_S ← mu·M_S``; ``v_S ← beta2·v_S + (1 − beta2)·
  mean_j O²``; ``U_S = O / (sqrt(v_S) + 1e-8)`` rescaled to ``‖O‖_F``; only S moves
  (all weights decay). No Nesterov, nothing bias-corrected.

  Args:
    learning_rate: base learning rate, a float or an optax schedule.
    fraction: the selected fraction of the output neurons, in (0, 1] (None: 1/4).
    mu: error-feedback decay of the selected neurons of M (the reference's name).
    muon_beta2: decay of the per-neuron second moment.
    selection_scope: on a mesh that shards the neurons, ``"global"`` (the reference's
      default: the exact top-k of the whole matrix, the same on every mesh) or
      ``"local"`` (each shard selects its own top neurons).
    num_heads: select and orthogonalize each head of the fan_out axis on its own (an
      int, a pytree of ints/None matching the parameters, or a callable).
  """
  return orthogonal_optimizer("nordion2", locals())


dion3 = nordion2
nordion2.__doc__ += COMMON_DOC
