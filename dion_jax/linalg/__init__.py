"""Orthonormal factors, the two kinds the optimizers need, under names that cannot collide.

- ``qr``: :func:`orthonormalize`, an orthonormal basis of a tall factor's columns
  (Dion's P): Householder, Cholesky or randomized Cholesky QR, rows possibly sharded.
- ``polar``: :func:`polar_factor`, the approximate polar factor ``U Vᵀ`` of whole
  matrices by odd quintic iterations (Muon, NorMuon, Dion2).
"""
from dion_jax.linalg.polar import NEWTON_SCHULZ, POLAR_EXPRESS, polar_factor
from dion_jax.linalg.qr import cholesky_qr_batch, householder, orthonormalize, rcqr

__all__ = [
    "NEWTON_SCHULZ",
    "POLAR_EXPRESS",
    "cholesky_qr_batch",
    "householder",
    "orthonormalize",
    "polar_factor",
    "rcqr",
]
