"""Muon, NorMuon and Dion2 in float64 NumPy, written from the papers' equations, as an
independent reference for dion_jax.scale_by_orthogonal. Matrices in the reference's (fan_out, fan_in)
layout; lr, weight decay and the shape scale sqrt(fan_out/fan_in) as microsoft/dion."""

import math

import numpy as np

POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
NEWTON_SCHULZ = [(3.4445, -4.7750, 2.0315)] * 5
# microsoft/dion's newton_schulz_triton_fast: four steps after the AOL rescaling.
RESCALED_NEWTON_SCHULZ = [(4.6051, -9.6552, 5.6769), (4.7505, -6.0861, 2.1790), (2.7763, -2.3190, 0.5523),
                          (2.4231, -2.2861, 0.8193)]  # fmt: skip


def polar(G, coefficients=POLAR_EXPRESS, safety=1.02, eps=1e-8, rescaled=False):
  """X ← a X + (b XᵀX + c (XᵀX)²) applied on the right of a tall X (left of a wide one);
  ``rescaled``: first scale each row (column) of the wide (tall) X by the inverse square
  root of the row's absolute sum in X Xᵀ (AOL, arXiv 2208.03160)."""
  X = np.asarray(G, np.float64)
  X = X / (np.linalg.norm(X) * safety + eps)
  if rescaled:
    wide = X if X.shape[0] <= X.shape[1] else X.T
    d = 1 / np.sqrt(np.abs(wide @ wide.T).sum(axis=1))
    X = d[:, None] * X if X.shape[0] <= X.shape[1] else X * d[None, :]
  for a, b, c in coefficients:
    if X.shape[0] > X.shape[1]:
      A = X.T @ X
      X = a * X + X @ (b * A + c * A @ A)
    else:
      A = X @ X.T
      X = a * X + (b * A + c * A @ A) @ X
  return X


def _apply(X, U, lr, wd, cautious=False):
  scale = math.sqrt(X.shape[0] / X.shape[1])
  mask = (X * U >= 0) if cautious else np.ones_like(X)
  return X - lr * wd * mask * X - lr * scale * U


def muon_steps(X, grads, lr, mu=0.95, wd=0.0, nesterov=False, cautious=False, normuon=False, beta2=0.95):
  """[(X, M)] after each step."""
  X, M = np.asarray(X, np.float64), np.zeros(np.shape(X))
  V = np.zeros((X.shape[0], 1))
  out = []
  for G in grads:
    M = mu * M + G
    U = polar(mu * M + G if nesterov else M)
    if normuon:
      V = beta2 * V + (1 - beta2) * np.mean(U * U, axis=1, keepdims=True)
      U_n = U / (np.sqrt(V) + 1e-8)
      U = U_n * np.linalg.norm(U) / max(np.linalg.norm(U_n), 1e-8)
    X = _apply(X, U, lr, wd, cautious)
    out.append((X, M.copy()))
  return out


def dion2_steps(X, grads, lr, fraction=0.25, ef_decay=0.95, wd=0.0):
  """[(X, M)] after each step; selects rows when fan_out <= fan_in, else columns."""
  X, M = np.asarray(X, np.float64), np.zeros(np.shape(X))
  rows = X.shape[0] <= X.shape[1]
  out = []
  for G in grads:
    M = M + G
    Mt = M if rows else M.T
    k = max(1, math.ceil(fraction * Mt.shape[0]))
    idx = np.argsort(-np.abs(Mt).sum(axis=1), kind="stable")[:k]
    U = np.zeros_like(Mt)
    U[idx] = polar(Mt[idx])
    Mt[idx] *= ef_decay
    X = _apply(X, U if rows else U.T, lr, wd)
    out.append((X, M.copy()))
  return out


def nordion2_steps(X, grads, lr, fraction=0.25, mu=0.95, beta2=0.95, wd=0.0):
  """[(X, M, V)] after each step: the k = ceil(fraction·m) rows of M + G with the largest
  L1 norms are orthogonalized, NorMuon-normalized (their second moments only) and
  applied; their rows of M decay by mu."""
  X, M = np.asarray(X, np.float64), np.zeros(np.shape(X))
  V = np.zeros((X.shape[0], 1))
  out = []
  for G in grads:
    M = M + G
    k = max(1, math.ceil(fraction * M.shape[0]))
    idx = np.argsort(-np.abs(M).sum(axis=1), kind="stable")[:k]
    O = polar(M[idx])
    M[idx] *= mu
    V[idx] = beta2 * V[idx] + (1 - beta2) * np.mean(O * O, axis=1, keepdims=True)
    N = O / (np.sqrt(V[idx]) + 1e-8)
    U = np.zeros_like(M)
    U[idx] = N * np.linalg.norm(O) / max(np.linalg.norm(N), 1e-8)
    X = _apply(X, U, lr, wd)
    out.append((X, M.copy(), V.copy()))
  return out
