"""Orthogonalization of whole matrices: the polar factor by odd quintic iterations.

Muon, NorMuon and Dion2 replace a matrix G (m x n, SVD ``G = U Σ Vᵀ``) by an
approximation of its polar factor ``U Vᵀ``. Every method here normalizes
``X₀ = G / (c·‖G‖_F + eps)`` (so every singular value is at most 1), makes X wide
(s x l, s = min(m, n)) and applies odd quintic polynomials to the singular values:

    A = X Xᵀ                          (s x s)
    P = a·I + b·A + c·A²              symmetric, as is A
    X ← P X

- ``"polar_express"`` (Amsel, Persson, Musco, Gower, arXiv 2505.16932): five steps,
  each with its own (a, b, c), chosen as the minimax-optimal polynomials for the
  range of singular values left by the previous step; c = 1.02, the safety factor
  baked into the coefficients. The reference's (microsoft/dion) default.
- ``"newton_schulz"``: Keller Jordan's quintic Newton–Schulz, five steps of
  (3.4445, −4.7750, 2.0315), c = 1 (optax.contrib.muon's default).
- ``"rescaled_newton_schulz"``: four steps after an AOL rescaling (Prach & Lampert,
  arXiv 2208.03160; microsoft/dion's ``newton_schulz_triton_fast``): with
  ``dᵢ = (Σⱼ |Aᵢⱼ|)^(-1/2)``, ``X ← diag(d) X`` has spectral norm at most 1 and is
  closer to orthogonal than the Frobenius-normalized X, so four tuned steps (the
  reference's genetic-search coefficients) reach Newton–Schulz's range; the first
  step reuses ``diag(d) A diag(d)``. It orthogonalizes ``diag(d) G``, not G: an
  approximation of a different kind (docs/design.md §10 has its measured errors).

Gram evaluation (``gram=True``; Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz",
microsoft/dion's ``use_gram_newton_schulz``). Every iterate is ``X_t = Q_t X₀`` with
Q_t a polynomial in ``R = X₀X₀ᵀ``, so the steps can run on the s x s matrices alone:

    Q ← Q P,   R ← P R P,   X = Q X₀ at the end

with restarts (``X ← Q X``, ``R ← X Xᵀ``, ``Q ← I``) that keep rounding in R from
drifting away from Q X₀: before steps 2 and 4 of the five-step methods, before step 2
of the rescaled four (``Method.gram_restarts``). The same polynomials, so the same
result up to rounding; five steps take 12s²l + 22s³ flops against the standard
20s²l + 10s³ (rescaled four: 8s²l + 20s³ against 14s²l + 8s³). Used where the matrix is
at least twice as long as it is short (l ≥ 2s: MLP matrices, fused qkv kernels), where
it never takes more flops; the standard steps elsewhere. It runs XLA matmuls on every backend
(the Pallas kernels fuse the standard step's products).

Sharded (``axis_name``, inside ``shard_map``): the long side of G split over mesh axes, as
the rows of Dion's tall P are over tp. Every s x s Gram and the Frobenius norm are then
summed over those axes; everything else is local, so the result is each device's block of
the one-device result (up to the order of the sums). The products are XLA's then, with the
sum between A and A².

Precision: with ``dtype=jnp.bfloat16`` (the default, as the reference) the input
is rounded to bfloat16 and every product runs in bfloat16; ``jnp.float32`` keeps
float32 throughout at the highest matmul precision. The result is float32.

The two symmetric products A = X Xᵀ and A² of the standard step are where a kernel can
halve the work (``dion_jax.kernels.newton_schulz``); ``backend`` chooses it or the XLA
composition (``dion_jax.kernels.newton_schulz_xla``).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dion_jax import validation
from dion_jax.kernels import backend as backend_lib
from dion_jax.kernels import newton_schulz_xla
from dion_jax.parallel import collectives

# Polar Express, 5 iterations, safety factor 2e-2, cushion 2 (arXiv 2505.16932); the
# same five triples as microsoft/dion's polar_express.py.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NEWTON_SCHULZ = ((3.4445, -4.7750, 2.0315),) * 5
# The four steps that follow the AOL rescaling, as microsoft/dion's newton_schulz_triton_fast.
RESCALED_NEWTON_SCHULZ = (
    (4.6051, -9.6552, 5.6769),
    (4.7505, -6.0861, 2.1790),
    (2.7763, -2.3190, 0.5523),
    (2.4231, -2.2861, 0.8193),
)


class Method(NamedTuple):
  """One orthogonalization: its (a, b, c) per step, the safety factor c of the
  Frobenius normalization, whether the AOL rescaling precedes the steps, and the
  steps before which the Gram evaluation restarts from ``X = Q X₀``."""

  coefficients: tuple[tuple[float, float, float], ...]
  safety: float
  rescaled: bool
  gram_restarts: tuple[int, ...]


# Restarts measured in bf16 against a float64 SVD (docs/design.md §10): before steps 2
# and 4 the five-step methods are as accurate as their standard steps (one restart
# before step 2, the reference's, lets Polar Express's large first coefficients
# amplify rounding in R on ill-conditioned inputs); the rescaled four steps need one.
METHODS = {
    "polar_express": Method(POLAR_EXPRESS, 1.02, False, (2, 4)),
    "newton_schulz": Method(NEWTON_SCHULZ, 1.0, False, (2, 4)),
    "rescaled_newton_schulz": Method(RESCALED_NEWTON_SCHULZ, 1.0, True, (2,)),
}
DTYPES = (jnp.bfloat16, jnp.float32)


def check_dtype(ortho_dtype: Any) -> None:
  if jnp.dtype(ortho_dtype) not in [jnp.dtype(d) for d in DTYPES]:
    raise ValueError(f"ortho_dtype={ortho_dtype!r} is not supported; use jnp.bfloat16 or jnp.float32")


def uses_gram(s: int, l: int) -> bool:
  """Whether ``gram=True`` takes the Gram steps for a wide s x l matrix (module docstring)."""
  return l >= 2 * s


def flops(s: int, l: int, *, method: str = "polar_express", gram: bool = False) -> int:
  """Matmul flops of :func:`polar_factor` on one s x l matrix (s ≤ l), 2 per multiply-add,
  as executed (module docstring): standard steps 4s²l + 2s³ each; Gram steps 2s²l for R,
  2s³ for R² and for Q P, 4s³ for P R P, 4s²l per restart and 2s²l for Q X₀."""
  spec = METHODS[method]
  steps = len(spec.coefficients)
  if not (gram and uses_gram(s, l)):
    return steps * (4 * s * s * l + 2 * s**3)
  total = 2 * s * s * l + 2 * s * s * l  # R = X₀X₀ᵀ, and Q X₀ at the end
  for i in range(steps):
    total += 4 * s * s * l if i in spec.gram_restarts else 0
    total += 2 * s**3  # R²
    total += 2 * s**3 if i and i not in spec.gram_restarts else 0  # Q ← Q P
    total += 4 * s**3 if i + 1 < steps and i + 1 not in spec.gram_restarts else 0  # R ← P R P
  return total


def _aol(X, A):
  """``diag(d) X`` and ``diag(d) A diag(d)``, ``dᵢ = (Σⱼ |Aᵢⱼ|)^(-1/2)``: spectral norm ≤ 1.
  A zero row keeps d finite (the clamp) and stays zero."""
  row_sums = jnp.sum(jnp.abs(A.astype(jnp.float32)), axis=-1, keepdims=True)
  d = jax.lax.rsqrt(jnp.maximum(row_sums, jnp.finfo(jnp.float32).tiny)).astype(X.dtype)
  return d * X, d * A * jnp.swapaxes(d, -1, -2)


def _standard(X, method: Method, precision, products, gram):
  """The steps on X itself: ``X ← a·X + (b·A + c·A²) X``."""
  mm = lambda x, y: jnp.einsum("bst,btl->bsl", x, y, precision=precision)
  for i, (a, b, c) in enumerate(method.coefficients):
    if i == 0 and method.rescaled:
      A = gram(X)
      X, A = _aol(X, A)
      B = b * A + c * mm(A, A)
    else:
      B = products(X, b, c, precision)
    X = a * X + mm(B, X)
  return X


def _gram(X, method: Method, precision, gram):
  """The steps on the s x s matrices: ``Q ← Q P``, ``R ← P R P``; ``Q X₀`` at the end."""
  mm = lambda x, y: jnp.einsum("bst,btl->bsl", x, y, precision=precision)
  R = gram(X)
  if method.rescaled:
    X, R = _aol(X, R)
  identity = jnp.eye(X.shape[1], dtype=X.dtype)
  steps = len(method.coefficients)
  Q = None
  for i, (a, b, c) in enumerate(method.coefficients):
    if i in method.gram_restarts:
      X = mm(Q, X)
      R, Q = gram(X), None
    P = a * identity + b * R + c * mm(R, R)
    Q = P if Q is None else mm(Q, P)
    if i + 1 < steps and i + 1 not in method.gram_restarts:
      R = mm(P, mm(R, P))
  return mm(Q, X)


def polar_factor(
    G: jax.Array,
    *,
    method: str = "polar_express",
    dtype: Any = jnp.bfloat16,
    epsilon: float = 1e-8,
    backend: str = "auto",
    gram: bool = False,
    axis_name: collectives.Axes = None,
) -> jax.Array:
  """The approximate polar factor of every matrix of ``G`` (..., m, n); float32, same shape.

  Args:
    G: a matrix or a batch of them (leading axes).
    method: ``"polar_express"``, ``"newton_schulz"`` or ``"rescaled_newton_schulz"``
      (module docstring).
    dtype: ``jnp.bfloat16`` (round the input, compute in bf16) or ``jnp.float32``.
    epsilon: added to the scaled Frobenius norm that normalizes the input.
    backend: ``"auto"`` (Pallas on GPU, else XLA), ``"xla"`` or ``"pallas"``.
    gram: iterate on the s x s Gram matrix where the matrix is at least twice as long
      as it is short (module docstring).
    axis_name: mesh axes over which G's rows are sharded, inside ``shard_map``, G then
      at least as tall as wide in all (module docstring).
  """
  validation.check_choice("ortho_method", method, tuple(METHODS))
  check_dtype(dtype)
  validation.check_choice("backend", backend, backend_lib.BACKENDS)
  spec = METHODS[method]
  precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
  *batch, m, n = G.shape
  sharded = bool(collectives.names(axis_name))
  m_total = m * collectives.axis_size(axis_name)
  if sharded and m_total < n:
    raise ValueError(f"polar_factor with sharded rows takes a tall G, got {m_total} x {n} in all")
  X = G.reshape((-1, m, n)).astype(dtype)
  tall = m_total > n or sharded
  if tall:  # Work on the wide side: A is (min x min), the sums over the sharded rows.
    X = jnp.swapaxes(X, 1, 2)

  def gram_of(x):
    if not sharded:
      return jnp.einsum("bsl,btl->bst", x, x, precision=precision)
    # Summed over the rows' shards in float32 and rounded once, as on one device. The entries
    # go up to float32 first (their products are exact there): XLA's CPU runtime refuses a
    # bfloat16 x bfloat16 = float32 dot inside shard_map.
    x32 = x.astype(jnp.float32)
    return collectives.psum(jnp.einsum("bsl,btl->bst", x32, x32, precision=precision), axis_name).astype(x.dtype)

  norm = jnp.sqrt(collectives.psum(jnp.sum(jnp.square(X.astype(jnp.float32)), axis=(1, 2), keepdims=True), axis_name))
  X = (X / (norm * spec.safety + epsilon).astype(dtype)).astype(dtype)
  if gram and uses_gram(min(m_total, n), max(m_total, n)):
    X = _gram(X, spec, precision, gram_of)
  else:
    products = backend_lib.symmetric_products(backend)
    if sharded:
      products = functools.partial(newton_schulz_xla.xla_symmetric_products, gram=gram_of)
    X = _standard(X, spec, precision, products, gram_of)
  if tall:
    X = jnp.swapaxes(X, 1, 2)
  return X.astype(jnp.float32).reshape(G.shape)
