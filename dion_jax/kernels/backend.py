"""Which implementation runs a kernel family: Pallas on a GPU, XLA's composition elsewhere.

``backend`` is ``"auto"`` (Pallas when JAX's default backend is a GPU, else XLA),
``"xla"`` or ``"pallas"`` (on CPU the Pallas kernels run in the interpreter). The
Pallas modules are imported here, when first asked for: ``import dion_jax`` loads no
Pallas or Triton.
"""
from __future__ import annotations

from typing import Callable

import jax

from dion_jax.kernels import newton_schulz_xla, rcqr_xla

BACKENDS = ("auto", "xla", "pallas")


def resolve(backend: str) -> str:
  """``"xla"`` or ``"pallas"``; ``"auto"`` decided by the default backend when traced."""
  if backend == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return backend


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
