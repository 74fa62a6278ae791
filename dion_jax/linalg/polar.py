"""Orthogonalization of whole matrices: the polar factor by odd quintic iterations.

Muon, NorMuon and Dion2 replace a matrix G (m x n, SVD ``G = U Σ Vᵀ``) by an
approximation of its polar factor ``U Vᵀ``. Both methods here normalize
``X₀ = G / (c·‖G‖_F + eps)`` (so every singular value is at most 1) and apply odd
quintic polynomials to the singular values:

    A = X Xᵀ                          (s x s, s = min(m, n); X is made wide first)
    B = b·A + c·A²                    symmetric, as is A
    X ← a·X + B X

- ``"polar_express"`` (Amsel, Persson, Musco, Gower, arXiv 2505.16932): five steps,
  each with its own (a, b, c), chosen as the minimax-optimal polynomials for the
  range of singular values left by the previous step; c = 1.02, the safety factor
  baked into the coefficients. The reference's (microsoft/dion) default.
- ``"newton_schulz"``: Keller Jordan's quintic Newton–Schulz, five steps of
  (3.4445, −4.7750, 2.0315), c = 1 (optax.contrib.muon's default).

Precision: with ``dtype=jnp.bfloat16`` (the default, as the reference) the input
is rounded to bfloat16 and every product runs in bfloat16; ``jnp.float32`` keeps
float32 throughout at the highest matmul precision. The result is float32.

The two symmetric products A = X Xᵀ and A² are where a kernel can halve the work
(``dion_jax.kernels.newton_schulz``); ``backend`` chooses it or the XLA composition
(``dion_jax.kernels.newton_schulz_xla``).
"""

from typing import Any

import jax
import jax.numpy as jnp

from dion_jax import validation
from dion_jax.kernels import backend as backend_lib

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
METHODS = {"polar_express": (POLAR_EXPRESS, 1.02), "newton_schulz": (NEWTON_SCHULZ, 1.0)}
DTYPES = (jnp.bfloat16, jnp.float32)


def check_dtype(ortho_dtype: Any) -> None:
  if jnp.dtype(ortho_dtype) not in [jnp.dtype(d) for d in DTYPES]:
    raise ValueError(f"ortho_dtype={ortho_dtype!r} is not supported; use jnp.bfloat16 or jnp.float32")


def polar_factor(
    G: jax.Array,
    *,
    method: str = "polar_express",
    dtype: Any = jnp.bfloat16,
    epsilon: float = 1e-8,
    backend: str = "auto",
) -> jax.Array:
  """The approximate polar factor of every matrix of ``G`` (..., m, n); float32, same shape.

  Args:
    G: a matrix or a batch of them (leading axes).
    method: ``"polar_express"`` or ``"newton_schulz"`` (module docstring).
    dtype: ``jnp.bfloat16`` (round the input, compute in bf16) or ``jnp.float32``.
    epsilon: added to the scaled Frobenius norm that normalizes the input.
    backend: ``"auto"`` (Pallas on GPU, else XLA), ``"xla"`` or ``"pallas"``.
  """
  validation.check_choice("ortho_method", method, tuple(METHODS))
  check_dtype(dtype)
  validation.check_choice("backend", backend, backend_lib.BACKENDS)
  coefficients, safety = METHODS[method]
  precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
  products = backend_lib.symmetric_products(backend)
  *batch, m, n = G.shape
  X = G.reshape((-1, m, n)).astype(dtype)
  tall = m > n
  if tall:  # Work on the wide side: A is (min x min).
    X = jnp.swapaxes(X, 1, 2)
  norm = jnp.sqrt(jnp.sum(jnp.square(X.astype(jnp.float32)), axis=(1, 2), keepdims=True))
  X = (X / (norm * safety + epsilon).astype(dtype)).astype(dtype)
  for a, b, c in coefficients:
    B = products(X, b, c, precision)
    X = a * X + jnp.einsum("bst,btl->bsl", B, X, precision=precision)
  if tall:
    X = jnp.swapaxes(X, 1, 2)
  return X.astype(jnp.float32).reshape(G.shape)
