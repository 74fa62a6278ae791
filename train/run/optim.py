"""The learning-rate schedule and the optimizer of a run, from its Config.

Schedules are optax's, joined: a linear warmup to the peak ``--lr`` over
``--lr-warmup-steps`` (starting at lr / warmup, so the first step already moves), then
``--lr-decay-style`` down to ``--min-lr`` at ``--lr-decay-steps``.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import dion_jax
from train.run.config import Config

# The scalar optimizer's betas, as the reference's (docs/design.md §2).
B1, B2 = 0.9, 0.95


def schedule(cfg: Config) -> optax.Schedule:
  lr, end, warmup = cfg.learning_rate, cfg.min_lr, cfg.warmup_steps
  decay = max(cfg.decay_steps - warmup, 1)
  if cfg.lr_decay_style == "constant":
    after = optax.constant_schedule(lr)
  elif cfg.lr_decay_style == "linear":
    after = optax.linear_schedule(lr, end, decay)
  elif cfg.lr_decay_style == "cosine":
    after = optax.cosine_decay_schedule(lr, decay, alpha=end / lr)
  else:  # wsd: warmup, stable, then a linear decay over the last steps
    # The default anneal is a fifth of --lr-decay-steps (warmup included), as --help says.
    final = min(cfg.lr_wsd_decay_steps or max(cfg.decay_steps // 5, 1), decay)
    after = optax.join_schedules([optax.constant_schedule(lr), optax.linear_schedule(lr, end, final)],
                                 [decay - final])
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(lr / warmup, lr, warmup - 1), after], [warmup])


# Dion's default rank by the model's width (the largest of its matrices' shorter sides, the
# hidden size of a GPT): the smallest rank fraction within noise of full rank where measured
# (validation loss, best of three learning rates, 300 steps; README "Training"): at width 128
# (tiny) ranks 1/2 and 1/4 lost 0.06 and 0.13 to full rank; at 768 (small's width, 2 layers,
# 3 seeds) rank 1/2 lost 0.018 (seeds' spread 0.039) and rank 1/4 0.050 in every seed.
RANK_BY_WIDTH = ((768, 0.5), (0, 1.0))  # (from this width, rank fraction), widest first


def default_rank_fraction(width: int) -> float:
  """Dion's rank fraction for a model whose widest matrices' shorter side is ``width``."""
  return next(fraction for start, fraction in RANK_BY_WIDTH if width >= start)


def rank_fraction(cfg: Config, params: Any) -> float:
  """``--dion-rank-fraction``, or by default :func:`default_rank_fraction` of ``params``."""
  if cfg.dion_rank_fraction is not None:
    return cfg.dion_rank_fraction
  widths = [min(p.shape[-2:]) for p, label in zip(jax.tree.leaves(params), jax.tree.leaves(dion_jax.default_labels(params)))
            if label == "dion"]
  return default_rank_fraction(max(widths, default=0))


def per_replica_mask(cfg: Config, params: Any, mesh: jax.sharding.Mesh) -> Any | None:
  """Which leaves get one gradient per rp replica (Dion's compressed sync), or None."""
  if cfg.optimizer != "dion" or not cfg.dion_replicate_sync or dict(mesh.shape)["rp"] == 1:
    return None
  return jax.tree.map(lambda label: label == "dion", dion_jax.default_labels(params))


def _optax_everywhere(cfg: Config, lr: optax.Schedule, params: Any) -> optax.GradientTransformation:
  """optax's adamw or lion on every parameter: ``--weight-decay`` on the matrices that
  the Dion family would take, ``--scalar-weight-decay`` on the rest."""
  make = {"adamw": optax.adamw, "lion": optax.lion}[cfg.optimizer]
  if cfg.weight_decay == cfg.scalar_weight_decay:  # One state, as runs saved before the split.
    return make(lr, b1=B1, b2=B2, weight_decay=cfg.weight_decay)
  decays = {"matrix": cfg.weight_decay, "scalar": cfg.scalar_weight_decay}
  groups = jax.tree.map(lambda label: "matrix" if label == "dion" else "scalar", dion_jax.default_labels(params))
  return optax.partition({k: make(lr, b1=B1, b2=B2, weight_decay=wd) for k, wd in decays.items()}, groups)


def optimizer(cfg: Config, params: Any, mesh: jax.sharding.Mesh, specs: Any) -> optax.GradientTransformation:
  """The update rule of ``--optimizer`` (without clipping: the train step clips)."""
  lr = schedule(cfg)
  if cfg.optimizer in ("adamw", "lion"):
    return _optax_everywhere(cfg, lr, params)
  decay = dict(weight_decay=cfg.weight_decay, scalar_weight_decay=cfg.scalar_weight_decay)
  if cfg.optimizer in ("dion2", "nordion2", "normuon", "muon"):
    # They orthogonalize whole (or selected parts of) matrices from the averaged
    # gradient: no per-replica gradients (replicate_sync=False).
    # Dion2 and NorDion2 select by the exact top-k of the whole matrix ("global"), so
    # that every mesh trains like one device.
    family, kw = {"dion2": (dion_jax.dion2, {"selection_scope": "global"}),
                  "nordion2": (dion_jax.nordion2, {"selection_scope": "global"}),
                  "normuon": (dion_jax.normuon, {}), "muon": (dion_jax.muon, {})}[cfg.optimizer]
    return family(lr, **decay, scale_rule=cfg.dion_scale_rule,
                  scalar_optimizer=cfg.dion_scalar_optimizer, mesh=mesh, partition_specs=specs,
                  ortho_dtype=jnp.dtype(cfg.ortho_dtype), replicate_sync=False,
                  megabatch_bytes=cfg.megabatch_bytes, **kw)
  return dion_jax.dion(
      lr,
      rank_fraction=rank_fraction(cfg, params),
      mu=cfg.dion_momentum,
      **decay,
      qr_method=cfg.dion_qr_method,
      power_precision=None if cfg.dion_power_precision == "default" else cfg.dion_power_precision,
      qr_precision=cfg.dion_qr_precision,
      scale_rule=cfg.dion_scale_rule,
      scalar_optimizer=cfg.dion_scalar_optimizer,
      seed=cfg.seed,
      mesh=mesh,
      partition_specs=specs,
      replicate_sync=cfg.dion_replicate_sync,
      mixed_precision=cfg.dion_mixed_precision,
      split_q=cfg.dion_split_q,
      megabatch_bytes=cfg.megabatch_bytes,
  )
