"""The matrix algebra of Muon, NorMuon, Dion2 and NorDion2 on a batch of (sharded) matrices.

All four keep a momentum M per matrix and return an update direction U built from a
polar factor (``dion_jax.linalg.polar``); weight decay and the learning rate are
chained after them (``dion_jax.optimizers.routing``). In the reference's (fan_out, fan_in) frame, with
gradient G:

Muon (Keller Jordan; microsoft/dion ``muon.py``)::

    M ← mu·M + G;   U = polar(mu·M + G if nesterov else M)

NorMuon (arXiv 2510.05491): Muon's U, then per output neuron (row) i, with
``v`` (fan_out x 1) a second moment of U's rows::

    v ← beta2·v + (1 − beta2)·mean_j U_ij²
    U' = U / (sqrt(v) + 1e-8);   U ← U'·‖U‖_F / max(‖U'‖_F, 1e-8)

Dion2 (arXiv 2512.16928): along the shorter side (fan_out on a tie), of length s, pick
the k = ceil(fraction·s) slices (rows or columns) of M + G with the largest L1 norms::

    M ← M + G;   S = top-k slices of M;   M_S ← ef_decay·M_S;   U_S = polar(M_S)

and U is zero outside the selected slices.

NorDion2 (microsoft/dion ``nordion2.py``, exported as ``Dion3``): Dion2's selection and
error feedback, always on output neurons (rows in this frame, whatever the shape), with
its decay named ``mu``, then NorMuon's normalization of the selected rows only::

    M ← M + G;   S = top-k rows of M;   M_S ← mu·M_S;   O_S = polar(M_S)
    v_S ← beta2·v_S + (1 − beta2)·mean_j O_Sj²;   U_S = O_S / (sqrt(v_S) + 1e-8), rescaled to ‖O‖_F

and v of the other rows is left as it is.

Layout: every function takes (B, a, b) blocks, the parameter's matrix axes in their own
order (no transposes of M), and :class:`Axes`, the mesh axes that shard a and b
inside ``shard_map`` (none on one device). Whole matrices are assembled one device
per matrix by ``dion_jax.parallel.megabatch``; Dion2 moves only its selected slices.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dion_jax.linalg.polar import polar_factor
from dion_jax.parallel import megabatch
from dion_jax.parallel.collectives import axis_size, psum

ALGORITHMS = ("muon", "normuon", "dion2", "nordion2")
SELECTION_SCOPES = ("local", "global")


class Axes(NamedTuple):
  """Mesh axes sharding the matrix axes 1 (``a``) and 2 (``b``) of (B, a, b) blocks."""

  a: tuple[str, ...] = ()
  b: tuple[str, ...] = ()


class FamilyHyperParams(NamedTuple):
  """Hyper-parameters of the matrix step (see :func:`dion_jax.scale_by_orthogonal`)."""

  algorithm: str = "muon"
  mu: Any = 0.95
  nesterov: bool = False
  muon_beta2: Any = 0.95
  fraction: float = 0.25
  ef_decay: Any = 0.95
  selection_scope: str = "local"
  epsilon: float = 1e-8
  ortho_method: str = "polar_express"
  ortho_dtype: Any = jnp.bfloat16
  backend: str = "auto"
  gram_newton_schulz: bool = False


def _polar(X: jax.Array, hp: FamilyHyperParams) -> jax.Array:
  """Polar factors of whole matrices, returned in ``ortho_dtype`` for the trip back."""
  out = polar_factor(X, method=hp.ortho_method, dtype=hp.ortho_dtype, epsilon=hp.epsilon, backend=hp.backend,
                     gram=hp.gram_newton_schulz)
  return out.astype(hp.ortho_dtype)


def polar_of_blocks(X_bxaxb: jax.Array, hp: FamilyHyperParams, axes: Axes) -> jax.Array:
  """Polar factors of sharded matrices: gathered whole one device per matrix, in
  ``ortho_dtype`` (bf16 halves the bytes on the wire, as the reference), and sent back."""
  X = X_bxaxb.astype(hp.ortho_dtype)
  whole = megabatch.gather(X, axes.a, axes.b)
  return megabatch.scatter(_polar(whole, hp), axes.a, axes.b, X.shape[0]).astype(jnp.float32)


def muon_step(M, G, hp: FamilyHyperParams, axes: Axes = Axes()):
  """Muon's ``(M, U)``; U float32, M in its own dtype."""
  M = (hp.mu * M + G.astype(M.dtype)).astype(M.dtype)
  X = hp.mu * M + G.astype(M.dtype) if hp.nesterov else M
  return M, polar_of_blocks(X, hp, axes)


def normuon_normalize(U, V, hp: FamilyHyperParams, axes: Axes, fan_in_axis: int, selected=None):
  """NorMuon's row normalization of U (B, a, b); ``V`` has U's shape with the fan_in
  axis of size 1, as has ``selected`` (bool), the neurons whose V is updated (all when
  None; NorDion2 updates only its selected rows, whose U is zero elsewhere). Returns
  ``(U, V)`` in float32 and V's dtype."""
  names_in = axes.a if fan_in_axis == 1 else axes.b
  fan_in = U.shape[fan_in_axis] * axis_size(names_in)
  U = U.astype(jnp.float32)
  frobenius = lambda X: jnp.sqrt(psum(jnp.sum(X * X, axis=(1, 2), keepdims=True), axes.a + axes.b))
  norm = frobenius(U)
  neuron = psum(jnp.sum(U * U, axis=fan_in_axis, keepdims=True), names_in) / fan_in
  V32 = V.astype(jnp.float32)
  updated = V32 + (1 - hp.muon_beta2) * (neuron - V32)
  V32 = updated if selected is None else jnp.where(selected, updated, V32)
  U_n = U / (jnp.sqrt(V32) + 1e-8)
  U_n = U_n * (norm / jnp.maximum(frobenius(U_n), 1e-8))
  return U_n, V32.astype(V.dtype)


def dion2_step(M, G, hp: FamilyHyperParams, axes: Axes, select_axis: int, s_total: int):
  """Dion2's ``(M, U, selected)`` on (B, a, b) blocks, selecting slices along
  ``select_axis`` (1 or 2) of global length ``s_total``; ``selected`` (bool) is True on
  the selected slices, of shape (B, s, 1) or (B, 1, s).

  ``"global"``: the L1 norms of all s slices are assembled on every device (s floats
  per matrix), the exact top-k is taken there, and each device sends only the
  selected slices it owns (zeros elsewhere; a reduce-scatter adds them exactly).
  ``"local"``: each shard of the selection axis takes its own top-ceil(fraction·s/N)
  slices, and these are assembled. Both equal one device when that axis is unsharded.
  """
  B = (M + G.astype(M.dtype)).astype(M.dtype)
  Bs = B if select_axis == 1 else jnp.swapaxes(B, 1, 2)  # (batch, s_l, l_l)
  names_s, names_l = (axes.a, axes.b) if select_axis == 1 else (axes.b, axes.a)
  batch, s_local = Bs.shape[:2]
  norms_bxs = psum(jnp.sum(jnp.abs(Bs.astype(jnp.float32)), axis=2), names_l)
  is_global = hp.selection_scope == "global" or not names_s
  if is_global:
    k = max(1, math.ceil(hp.fraction * s_total))
    if names_s:
      norms_bxs = jax.lax.all_gather(norms_bxs, names_s, axis=1, tiled=True)
    idx_bxk = jax.lax.top_k(norms_bxs, k)[1]
    offset = jax.lax.axis_index(names_s) * s_local if names_s else 0
    idx_bxk = idx_bxk - offset
    owned = (idx_bxk >= 0) & (idx_bxk < s_local)
    idx_bxk = jnp.where(owned, idx_bxk, s_local)  # Out of range: dropped by the scatters.
  else:
    k = max(1, math.ceil(hp.fraction * s_local))
    idx_bxk = jax.lax.top_k(norms_bxs, k)[1]
    owned = jnp.ones(idx_bxk.shape, bool)
  rows = jnp.take_along_axis(Bs, jnp.minimum(idx_bxk, s_local - 1)[..., None], axis=1)
  rows = jnp.where(owned[..., None], rows, 0).astype(hp.ortho_dtype)  # (batch, k, l_l)
  if is_global:
    whole = megabatch.reduce_to_owner(rows, names_s, names_l)
    U_rows = megabatch.broadcast_from_owner(_polar(whole, hp), names_s, names_l, batch)
  else:
    whole = megabatch.gather(rows, names_s, names_l)
    U_rows = megabatch.scatter(_polar(whole, hp), names_s, names_l, batch)
  b_idx = jnp.arange(batch)[:, None]
  U = jnp.zeros(Bs.shape, jnp.float32).at[b_idx, idx_bxk].set(U_rows.astype(jnp.float32), mode="drop")
  selected = jnp.zeros((batch, s_local), bool).at[b_idx, idx_bxk].set(True, mode="drop")
  Bs = jnp.where(selected[..., None], hp.ef_decay * Bs, Bs).astype(M.dtype)
  selected = selected[..., None]
  if select_axis == 2:
    Bs, U, selected = (jnp.swapaxes(x, 1, 2) for x in (Bs, U, selected))
  return Bs, U, selected
