"""Orthonormal factors, the two kinds the optimizers need, under names that cannot collide.

- ``qr``: :func:`orthonormalize`, an orthonormal basis of a tall factor's columns
  (Dion's P): shifted Cholesky QR (batched, the default), one-pass or randomized Cholesky QR,
  Householder, Polar Express; rows possibly sharded.
- ``cholesky``: :func:`inverse_cholesky`, the inverse Cholesky factor of a batch of r x r
  Grams in a few batched launches (Cholesky QR's factor and solve).
- ``polar``: :func:`polar_factor`, the approximate polar factor ``U Vᵀ`` of whole
  matrices by odd quintic iterations (Muon, NorMuon, Dion2).
- ``tf32``: float32 matmuls as three TF32 products on a GPU's tensor cores (Cholesky
  QR's ``precision="tensorfloat32x3"``), emulated elsewhere.
"""
from dion_jax.linalg.cholesky import inverse_cholesky
from dion_jax.linalg.polar import NEWTON_SCHULZ, POLAR_EXPRESS, polar_factor
from dion_jax.linalg.qr import (
    cholesky_qr_batch,
    householder,
    orthonormalize,
    orthonormalize_batch,
    rcqr,
    resolve_method,
    shifted_cholesky_qr,
)

__all__ = [
    "NEWTON_SCHULZ",
    "POLAR_EXPRESS",
    "cholesky_qr_batch",
    "householder",
    "inverse_cholesky",
    "orthonormalize",
    "orthonormalize_batch",
    "polar_factor",
    "rcqr",
    "resolve_method",
    "shifted_cholesky_qr",
]
