"""Which implementation runs a kernel family: XLA's composition or the Pallas kernels.

``backend`` is ``"auto"`` (whatever the last GPU measurement found faster at equal
accuracy: today XLA on every platform), ``"xla"`` or ``"pallas"`` (on CPU the Pallas
kernels run in the interpreter). On the H100 (``benchmarks/results/gpu/``) the Pallas
kernels ran at 0.28–0.81x of XLA's speed for RCQR and 0.63–0.97x for the Newton–Schulz
products; XLA's passes now run their float32 matmuls at ``Precision.HIGHEST``, so the
kernels' accuracy edge over XLA's default TF32 is gone too. One family differs: the
inverse-Cholesky leaf (``dion_jax.kernels.cholesky``), whose ``"auto"`` is Pallas on a GPU,
chosen by structure before any GPU timing (:func:`cholesky_and_inverse`). The Pallas modules are
imported here, when first asked for: ``import dion_jax`` loads no Pallas or Triton.
"""
from __future__ import annotations

from typing import Callable

import jax

from dion_jax.kernels import cholesky_xla, newton_schulz_xla, rcqr_xla

BACKENDS = ("auto", "xla", "pallas")


def resolve(backend: str) -> str:
  """``"xla"`` or ``"pallas"``; ``"auto"`` is ``"xla"`` (module docstring)."""
  return "xla" if backend == "auto" else backend


def rcqr_passes(backend: str) -> tuple[Callable, Callable, Callable]:
  """RCQR's (sketch_product, solve_and_gram, solve) on ``backend``."""
  if resolve(backend) == "xla":
    return rcqr_xla.xla_sketch_product, rcqr_xla.xla_solve_and_gram, rcqr_xla.xla_solve
  from dion_jax.kernels import rcqr

  return rcqr.sketch_product, rcqr.solve_and_gram, rcqr.solve


def symmetric_products(backend: str) -> Callable:
  """The polar iterations' ``(X, b, c, precision) -> b·XXᵀ + c·(XXᵀ)²`` on ``backend``."""
  if resolve(backend) == "xla":
    return newton_schulz_xla.xla_symmetric_products
  from dion_jax.kernels import newton_schulz

  return newton_schulz.symmetric_products


def cholesky_and_inverse(backend: str) -> Callable:
  """The Cholesky factor of a batch of small blocks and its inverse, ``A (B, n, n) -> (L, L⁻¹)``.

  ``"auto"`` is the Pallas kernel on a GPU and XLA's loop elsewhere (decided when
  traced). On a GPU XLA's loop would launch n kernels with a host round trip each, and
  cuSOLVER's batched Cholesky about 2n/16 launches plus a triangular inverse; the kernel
  is one launch for the batch. Chosen by that count: no GPU has timed it yet.
  """
  if backend == "xla" or (backend == "auto" and jax.default_backend() != "gpu"):
    return cholesky_xla.xla_cholesky_and_inverse
  from dion_jax.kernels import cholesky

  return cholesky.cholesky_and_inverse
