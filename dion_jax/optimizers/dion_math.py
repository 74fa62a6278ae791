"""Dion's matrix algebra: one step on a batch of matrices, on one device or a shard.

Dion (Ahn, Xu, Abreu, Langford, "Dion: Distributed Orthonormalized Updates",
arXiv 2504.05295) keeps, per matrix, a momentum M (the parameter's shape) and a
right factor Q (cols x r). With B the momentum in the working frame (rows x cols,
see ``dion_jax.optimizers.frame``), one step on gradient G is:

    M ← M + G
    P ← orthonormalize(B Q)                      P: rows x r
    R ← Bᵀ P                                     R: cols x r
    M ← M − (1 − mu) P Rᵀ                        error feedback (in B's frame)
    Q ← R / (‖R‖_col + eps)                      column norms in float32
    U ← scale(fan_out, fan_in) · P Qᵀ            the returned update direction

with a guard: if M is all zero (seen as B Q = 0), or P or R is not finite anywhere (a
factorization that failed), P = 0 and R = Q: that matrix's Q is left alone and its step
is the momentum's update only. (The reference replaces NaN in P and R by 0, which makes
Q zero, and a zero Q never leaves zero: the matrix stops learning for good.) ``power_iters > 1`` repeats the
P/R products with Q ← R. Weight decay and the learning rate are applied by the
transformations chained after ``scale_by_dion`` (``dion_jax.optimizers.routing``), which gives the
reference's ``X ← (1 − lr·wd) X − lr·scale·P Qᵀ``.

Every line above is local to a device except a few small reductions, named by
:class:`Collectives`: sums over the mesh axes that shard B's columns (P = B Q and
the column norms) and rows (the orthonormalization's sketch and Gram, R = Bᵀ P),
and a mean of P and R over data-parallel replicas (compressed sync). On one device
all are identities; ``dion_jax.optimizers.dion`` runs the same function inside
``shard_map`` on a mesh and wraps it as the optax transformation ``scale_by_dion``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dion_jax.linalg import qr, tf32
from dion_jax.optimizers.frame import MatrixFrame
from dion_jax.parallel import collectives

AxisName = collectives.Axes


class Collectives(NamedTuple):
  """Mesh axes for the reductions of one matrix step (None: not sharded)."""

  rows: AxisName = None  # Axes sharding B's rows: sums for orthonormalization and R.
  cols: AxisName = None  # Axes sharding B's columns: sums for P and Q's column norms.
  replica: AxisName = None  # Replica axes over which P and R are averaged.
  everywhere: AxisName = None  # All mesh axes a matrix spans, for the guard (all zero or not finite).
  spread: bool = False  # Split the batch's orthonormalizations over cols + replica axes.


class DionHyperParams(NamedTuple):
  """Hyper-parameters of the matrix step (see :func:`dion_jax.scale_by_dion`)."""

  mu: Any = 0.95
  epsilon: Any = 1e-8
  qr_method: str = "auto"
  oversample: float = 1.25
  power_iters: int = 1
  backend: str = "auto"
  power_precision: str | None = None
  qr_precision: str = "float32"


def _orthonormalize_batch(P_bxrxr, seed, use_cqr, hp: DionHyperParams, axes: Collectives):
  return qr.orthonormalize_batch(
      P_bxrxr, method=hp.qr_method, seed=seed, oversample=hp.oversample, use_cqr=use_cqr,
      axis_name=axes.rows, backend=hp.backend, precision=hp.qr_precision,
  )  # fmt: skip


def _power_left(MR_partial_bxrxr, seed, use_cqr, hp: DionHyperParams, axes: Collectives):
  """Reduces the partial products B Q over columns (and replicas), orthonormalizes them.

  With ``axes.spread``, the reduction is a reduce-scatter along the batch, so each
  device of the column/replica group orthonormalizes its own share of the matrices,
  and an all-gather brings every P back: the same bytes on the wire as an
  all-reduce, 1/group of the orthonormalization work. Either way the replicas average
  1/|cols| of P each (``collectives.sum_then_mean``): over rp a device sends its share of
  the (rows + cols)·r of compressed sync, not the whole P.
  """
  if not (axes.spread and (axes.cols or axes.replica)):
    P = collectives.sum_then_mean(MR_partial_bxrxr, axes.cols, axes.replica)
    return _orthonormalize_batch(P, seed, use_cqr, hp, axes)
  P_local = collectives.scatter_sum_then_mean(MR_partial_bxrxr, axes.cols, axes.replica)
  P_local = _orthonormalize_batch(P_local, seed, use_cqr, hp, axes)
  return collectives.gather_back(P_local, axes.cols, axes.replica)


POWER_PRECISIONS = (None, "float32", "tensorfloat32", "bfloat16")


def _operands(precision: str | None):
  """``(cast, dot_precision)`` of B Q and Bᵀ P for ``power_precision`` (see ``scale_by_dion``):
  what each operand becomes and the matmul's precision. TF32 is the GPU's own dot
  algorithm; elsewhere (XLA's CPU has none) its rounding, emulated, before a float32 matmul."""
  if precision == "bfloat16":
    return (lambda x: x.astype(jnp.bfloat16)), None
  if precision == "tensorfloat32":
    if jax.default_backend() == "gpu":
      return (lambda x: x.astype(jnp.float32)), jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    return tf32.round_to_tf32, jax.lax.Precision.HIGHEST
  if precision == "float32":
    return (lambda x: x.astype(jnp.float32)), jax.lax.Precision.HIGHEST
  return (lambda x: x), None


def _contract(M: jax.Array, X: jax.Array, over_last: bool, precision=None) -> jax.Array:
  """``M`` (B, a, c) times ``X`` over one matrix axis of M, float32 accumulation.

  ``over_last``: Σ_c M[a, c] X[c, r] -> (B, a, r); else Σ_a M[a, c] X[a, r] -> (B, c, r).
  The second form is computed as (Xᵀ M)ᵀ with the small transposes kept out of
  the dot by optimization barriers: XLA would fold them back into a transposed-LHS
  GEMM, which runs at about half the plain one's speed on CPU.
  """
  mm = lambda spec, a, b: jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)
  if over_last:
    return mm("bac,bcr->bar", M, X)
  barrier = jax.lax.optimization_barrier if jax.default_backend() == "cpu" else (lambda x: x)
  Xt_bxrxa = barrier(jnp.swapaxes(X, 1, 2))
  out_bxrxc = barrier(mm("bra,bac->brc", Xt_bxrxa, M))
  return jnp.swapaxes(out_bxrxc, 1, 2)


def _factors(B, Q_bxcxr, seed, use_cqr, hp: DionHyperParams, axes: Collectives, rows_last: bool):
  """The low-rank factors ``(P, R)`` of one step: power iteration on the momentum B
  (B x rows x cols, or B x cols x rows when ``rows_last``) warm-started from Q, with
  the guard applied (all-zero or non-finite: P = 0, R = Q). Both are returned in B's dtype."""
  dtype = B.dtype
  cast, precision = _operands(hp.power_precision)
  B_op = cast(B)  # once for both products
  B_times = lambda X: _contract(B_op, cast(X), not rows_last, precision)  # B X
  Bt_times = lambda X: _contract(B_op, cast(X), rows_last, precision)  # Bᵀ X
  Q0_bxcxr = Q_bxcxr.astype(dtype)
  R_bxcxr = Q0_bxcxr
  for i in range(hp.power_iters):
    BQ_bxrxr = B_times(R_bxcxr)
    if i == 0:
      # M = 0 exactly when B Q0 = 0 for a Q0 of full rank r spanning M's row space
      # (Q is B's last image): testing the (rows x r) product spares a pass over M.
      # max |.| is one fused reduction; jnp.any(x != 0) materializes a boolean array on CPU.
      largest_b = jnp.max(jnp.abs(BQ_bxrxr), axis=(1, 2))
    P_bxrxr = _power_left(BQ_bxrxr, seed, use_cqr, hp, axes).astype(dtype)
    R_bxcxr = collectives.sum_then_mean(Bt_times(P_bxrxr), axes.rows, axes.replica).astype(dtype)

  # One int32 sum over the matrix's devices decides both: the low 16 bits count the shards
  # where B Q is nonzero, the high ones those where P or R is not finite.
  finite_b = jnp.logical_and(jnp.all(jnp.isfinite(P_bxrxr), axis=(1, 2)), jnp.all(jnp.isfinite(R_bxcxr), axis=(1, 2)))
  flags_b = (largest_b != 0).astype(jnp.int32) + (1 << 16) * jnp.logical_not(finite_b).astype(jnp.int32)
  flags_b = collectives.psum(flags_b, axes.everywhere)
  ok_bx1x1 = jnp.logical_and(flags_b % (1 << 16) > 0, flags_b < (1 << 16))[:, None, None]
  return jnp.where(ok_bx1x1, P_bxrxr, 0), jnp.where(ok_bx1x1, R_bxcxr, Q0_bxcxr)


def _matrix_by_matrix(axes: Collectives, batch: int) -> bool:
  """Whether to run the batch's power iteration and error feedback one matrix at a time.

  On a CPU that keeps one matrix of B in cache from B Q through Bᵀ P to the error
  feedback, which overwrites it in place (a ``scan`` carrying B): two passes over
  the momentum fewer than the batched step. With collectives the batch stays whole:
  spreading splits it over devices, and collectives inside a loop would be hidden
  from the HLO accounting of ``dion_jax.accounting``.
  """
  return batch > 1 and jax.default_backend() == "cpu" and not any(axes[:4])


def dion_matrix_step(
    M: jax.Array,
    G: jax.Array,
    Q_bxcxr: jax.Array,
    seed: jax.Array,
    use_cqr: jax.Array,
    scale: float,
    hp: DionHyperParams,
    axes: Collectives = Collectives(),
    rows_last: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One Dion step on a batch of B matrices (this device's block of them).

  Args:
    M: momentum, (B, rows, cols), or (B, cols, rows) when ``rows_last``: B's matrices
      are read in the parameter's own layout, never transposed in memory.
    G: gradient, same layout.
    Q_bxcxr: right factor, (B, cols, r), rows split like M's columns.
    seed: uint32 seed of this step's RCQR sketch, the same on every replica. One
      sketch serves every matrix of the step: each needs a subspace embedding of its
      own P, which a shared sketch is, and on a CPU it is then generated once.
    use_cqr: whether ``"cqr"`` may run (after warmup).
    scale: the shape-dependent update scale.
    hp: hyper-parameters.
    axes: mesh axes of the reductions.
    rows_last: the layout of M and G (above).

  Returns:
    ``(M, Q, U)``: the new momentum and Q, and the update ``scale·P Qᵀ`` in M's
    layout and dtype.
  """
  mat = "bnm" if rows_last else "bmn"  # m: rows of B, n: its columns, r: rank.
  mm = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  dtype = M.dtype
  factors = lambda B, Q: _factors(B, Q, seed, use_cqr, hp, axes, rows_last)
  # Scalars multiply the small factor, not the (rows x cols) product: one pass fewer.
  feedback = lambda B, P, R: B - mm(f"bmr,bnr->{mat}", (1 - hp.mu) * P, R).astype(dtype)
  B = M + G.astype(dtype)
  if _matrix_by_matrix(axes, B.shape[0]):

    def one_matrix(B, i_and_Q):
      i, Q_cxr = i_and_Q
      B_i = jax.lax.dynamic_index_in_dim(B, i)
      P_i, R_i = factors(B_i, Q_cxr[None])
      return jax.lax.dynamic_update_index_in_dim(B, feedback(B_i, P_i, R_i), i, 0), (P_i[0], R_i[0])

    M, (P_bxrxr, R_bxcxr) = jax.lax.scan(one_matrix, B, (jnp.arange(B.shape[0]), Q_bxcxr))
  else:
    P_bxrxr, R_bxcxr = factors(B, Q_bxcxr)
    M = feedback(B, P_bxrxr, R_bxcxr)

  R32_bxcxr = R_bxcxr.astype(jnp.float32)
  col_norm_bx1xr = jnp.sqrt(collectives.psum(jnp.sum(R32_bxcxr**2, axis=1, keepdims=True), axes.cols))
  Q_bxcxr = (R32_bxcxr / (col_norm_bx1xr + hp.epsilon)).astype(dtype)
  U = mm(f"bmr,bnr->{mat}", scale * P_bxrxr, Q_bxcxr)
  return M, Q_bxcxr, U.astype(dtype)


def update_batched(
    fr: MatrixFrame,
    M: jax.Array,
    G: jax.Array,
    Q: jax.Array,
    seed: jax.Array,
    use_cqr: jax.Array,
    scale: float,
    hp: DionHyperParams,
    axes: Collectives = Collectives(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`dion_matrix_step` on every matrix of a (stacked) parameter.

  ``M`` and ``G`` are in the parameter's layout (or this device's block of it),
  ``Q`` is (*batch, cols, r) and ``seed`` a uint32 scalar. Returns ``(M, Q, U)`` with
  ``U`` in the parameter's layout.
  """
  M, G = fr.to_batch_first(M), fr.to_batch_first(G)
  batch = M.shape[:-2]
  flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])
  M, Q, U = dion_matrix_step(
      flat(M), flat(G), flat(Q), seed, use_cqr, scale, hp, axes, fr.rows_last
  )
  unflat = lambda x: x.reshape(batch + x.shape[1:])
  return fr.from_batch_first(unflat(M)), unflat(Q), fr.from_batch_first(unflat(U))
