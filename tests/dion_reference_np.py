"""An independent float64 NumPy implementation of Dion, for tests.

Written from the algorithm in docs/design.md §2 (the reference's frame: X is
(fan_out, fan_in)); it shares no code with dion_jax.
"""

import math

import numpy as np


def rank_of(m, n, rank_fraction, multiple=1):
  return min(math.ceil(rank_fraction * min(m, n) / multiple) * multiple, m, n)


def dion_steps(X, Q, grads, *, lr, mu, weight_decay, eps=1e-8, scale=None):
  """Runs Dion on X (m, n) with initial Q; returns the list of (X, M, Q) after each step."""
  X = X.astype(np.float64)
  Q = Q.astype(np.float64)
  m, n = X.shape
  transposed = m < n
  scale = math.sqrt(m / n) if scale is None else scale
  M = np.zeros_like(X)
  out = []
  for G in grads:
    M = M + G
    B = M.T if transposed else M
    P = np.linalg.qr(B @ Q)[0]
    R = B.T @ P
    if not M.any():
      P, R = np.zeros_like(P), Q
    PRt = P @ R.T
    M = M - (1 - mu) * (PRt.T if transposed else PRt)
    Q = R / (np.linalg.norm(R, axis=0, keepdims=True) + eps)
    U = P @ Q.T
    X = (1 - lr * weight_decay) * X - lr * scale * (U.T if transposed else U)
    out.append((X.copy(), M.copy(), Q.copy()))
  return out
