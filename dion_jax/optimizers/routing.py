"""Routing by labels: a matrix optimizer for matrices, a scalar optimizer for the rest.

Every optimizer of the package (``dion``, ``muon``, ``normuon``, ``dion2``) is
:func:`matrix_optimizer` around its matrix transformation: ``optax.partition`` over
labels, with for Dion:

- ``"dion"``: ``chain(scale_by_dion, add_decayed_weights(wd), scale_by_learning_rate(lr))``,
  i.e. ``X ← (1 − lr·wd) X − lr·scale·P Qᵀ`` as in the reference;
- ``"adamw"`` / ``"lion"``: optax's own ``adamw`` / ``lion`` with betas (0.9, 0.95);
- ``"lm_head"``: the scalar optimizer with the learning rate scaled by
  ``lm_head_lr_scale`` (the reference uses 1/sqrt(d_model) with Lion);
- ``"muon"``: ``optax.contrib.muon``, to compare both on one model; stacked matrices get
  Muon per matrix, with the fan_in/fan_out axes of ``dimension_numbers``.

For Muon, NorMuon and Dion2 too, ``"dion"`` labels the matrices that get the
package's orthonormal update.

The default labels (:func:`default_labels`) send every parameter with >= 2 dims to
Dion except embeddings and the LM head, which a Flax model names ``embed*`` /
``*embedding`` / ``wte`` and ``lm_head`` / ``head`` / ``unembed``; vectors, scalars,
and leaves named ``bias`` / ``scale`` / ``*norm*`` (stacked norms are vectors with
leading layer axes) go to the scalar optimizer.
"""

from typing import Any, Callable

import jax
import optax

from dion_jax import validation
from dion_jax.optimizers.frame import DionDimensionNumbers, per_leaf

LABELS = ("dion", "adamw", "lion", "lm_head", "muon")
SCALAR_OPTIMIZERS = ("adamw", "lion")
_EMBEDDING_NAMES = ("embed", "embedding", "wte", "wpe", "tok_embeddings")
# Flax names of norm scales and biases: vectors even when stacked over layers.
_VECTOR_NAMES = ("bias", "scale")
_HEAD_NAMES = ("lm_head", "head", "unembed", "output_layer")

def _key_names(path) -> list[str]:
  names = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)).lower())
        break
  return names


def default_labels(params: Any, scalar_optimizer: str = "adamw") -> Any:
  """Labels for :func:`dion`: ``"dion"``, ``scalar_optimizer`` or ``"lm_head"`` per leaf."""

  def label(path, leaf):
    names = _key_names(path)
    if any(n in _HEAD_NAMES for n in names):
      return "lm_head"
    vector_like = len(leaf.shape) < 2 or (names and names[-1] in _VECTOR_NAMES)
    if vector_like or any(e in n for n in names for e in _EMBEDDING_NAMES + ("norm",)):
      return scalar_optimizer
    return "dion"

  return jax.tree_util.tree_map_with_path(label, params)


def add_decayed_weights(weight_decay: optax.ScalarOrSchedule, cautious: bool = False) -> optax.GradientTransformation:
  """``u + wd·X``, or with ``cautious`` only where u and X agree in sign (u·X >= 0):
  the reference's ``cautious_wd`` (arXiv 2510.12402), which decays a weight only when
  the update moves it towards zero as well."""
  if not cautious:
    return optax.add_decayed_weights(weight_decay)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("cautious_wd needs the parameters: call update(updates, state, params)")
    decay = lambda u, p: u + weight_decay * p * (u * p >= 0).astype(p.dtype)
    return jax.tree.map(decay, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def matrix_optimizer(
    matrix_direction: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float,
    scalar_weight_decay: float | None = None,
    cautious_wd: bool = False,
    mu: float = 0.95,
    scalar_optimizer: str = "adamw",
    scalar_learning_rate: optax.ScalarOrSchedule | None = None,
    b1: float = 0.9,
    b2: float = 0.95,
    scalar_epsilon: float = 1e-8,
    lm_head_lr_scale: float | None = None,
    labels: Any = None,
    dimension_numbers=None,
) -> optax.GradientTransformation:
  """The skeleton every optimizer of the package shares: ``optax.partition`` by labels of
  ``chain(matrix_direction, weight decay, scale_by_learning_rate)`` for ``"dion"``
  leaves and the scalar optimizers for the rest (module docstring); ``mu`` and
  ``dimension_numbers`` also serve the ``"muon"`` label (optax.contrib.muon).
  ``scalar_weight_decay`` (default ``weight_decay``) is the scalar optimizers' and the
  LM head's decay: the reference's training recipe gives embeddings and LM head none."""
  validation.check_numbers(
      learning_rate=learning_rate, weight_decay=weight_decay, scalar_weight_decay=scalar_weight_decay,
      scalar_learning_rate=scalar_learning_rate, b1=b1, b2=b2, lm_head_lr_scale=lm_head_lr_scale,
  )  # fmt: skip
  validation.check_choice("scalar_optimizer", scalar_optimizer, SCALAR_OPTIMIZERS)
  scalar_lr = learning_rate if scalar_learning_rate is None else scalar_learning_rate
  scalar_wd = weight_decay if scalar_weight_decay is None else scalar_weight_decay

  def scalar(name, lr):
    if name == "lion":
      return optax.lion(lr, b1=b1, b2=b2, weight_decay=scalar_wd)
    return optax.adamw(lr, b1=b1, b2=b2, eps=scalar_epsilon, weight_decay=scalar_wd)

  def scaled(lr, factor):
    return (lambda count: lr(count) * factor) if callable(lr) else lr * factor

  matrix = optax.chain(
      matrix_direction,
      add_decayed_weights(weight_decay, cautious_wd),
      optax.scale_by_learning_rate(learning_rate),
  )

  def labels_of(params):
    if labels is None:
      return default_labels(params, scalar_optimizer)
    tree = labels(params) if callable(labels) else labels
    bad = {l for l in jax.tree.leaves(tree) if l not in LABELS}
    if bad:
      raise ValueError(f"unknown optimizer labels {sorted(bad)}; use labels from {LABELS}")
    return tree

  def transforms(params):
    head_scale = _lm_head_scale(params, lm_head_lr_scale, scalar_optimizer, labels_of)
    return {
        "dion": matrix,
        "adamw": scalar("adamw", scalar_lr),
        "lion": scalar("lion", scalar_lr),
        "lm_head": scalar(scalar_optimizer, scaled(scalar_lr, head_scale)),
        "muon": optax.contrib.muon(
            learning_rate, beta=mu, weight_decay=weight_decay,
            muon_weight_dimension_numbers=_muon_dimension_numbers(dimension_numbers),
        ),  # fmt: skip
    }

  def init_fn(params):
    return optax.partition(transforms(params), labels_of).init(params)

  def update_fn(updates, state, params=None):
    return optax.partition(transforms(updates), labels_of).update(updates, state, params)

  return optax.GradientTransformation(init_fn, update_fn)


def _muon_dimension_numbers(dimension_numbers) -> Callable[[Any], Any]:
  """optax Muon's dimension numbers from Dion's (None, one, a pytree or a callable).

  Without them optax's Muon sends every parameter that is not 2-D to Adam, so a stacked
  (layers, fan_in, fan_out) kernel labelled ``"muon"`` would silently not get Muon.
  """

  def to_muon(leaf, dims):
    if len(leaf.shape) < 2:
      return None  # Muon's Adam.
    dims = dims or DionDimensionNumbers()
    return optax.contrib.MuonDimensionNumbers(dims.reduction_axis, dims.output_axis)

  def fn(params):
    dims = per_leaf(dimension_numbers, params, lambda x: isinstance(x, DionDimensionNumbers))
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [to_muon(leaf, d) for leaf, d in zip(leaves, dims)])

  return fn


def _lm_head_scale(params, lm_head_lr_scale, scalar_optimizer, labels_of) -> float:
  if lm_head_lr_scale is not None:
    return lm_head_lr_scale
  if scalar_optimizer != "lion":
    return 1.0
  heads = [
      leaf for leaf, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels_of(params)))
      if label == "lm_head" and len(leaf.shape) >= 2
  ]  # fmt: skip
  return 1.0 / heads[0].shape[-2] ** 0.5 if heads else 1.0
