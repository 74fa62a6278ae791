"""The Cholesky leaf (the factor and its inverse): the Pallas kernel (interpreted) and its XLA
twin against float64 NumPy, and the kernel lowered for CUDA on CPU as one Triton module per batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion_jax.kernels import cholesky, cholesky_xla
from tests.triton_ir import parse_triton_modules


def _spd(batch, n, cond, seed=0):
  """float64 (batch, n, n) with eigenvalues logspaced from 1 to 1/cond."""
  rng = np.random.default_rng(seed)
  U = np.linalg.qr(rng.normal(size=(batch, n, n)))[0]
  return (U * np.logspace(0, -np.log10(cond), n)) @ np.swapaxes(U, 1, 2)


LEAVES = {"xla": cholesky_xla.xla_cholesky_and_inverse,
          "pallas": lambda A: cholesky.cholesky_and_inverse(A, interpret=True)}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
@pytest.mark.parametrize("n,cond", [(16, 1e2), (64, 1e4), (128, 1e3)])
def test_factor_and_inverse_match_float64(leaf, n, cond):
  A = _spd(3, n, cond, seed=n)
  L, X = (np.asarray(x, np.float64) for x in jax.jit(LEAVES[leaf])(jnp.asarray(A, jnp.float32)))
  L_ref = np.linalg.cholesky(A)
  X_ref = np.linalg.inv(L_ref)
  for M in (L, X):
    assert np.array_equal(np.triu(M, 1), np.zeros_like(M))  # lower triangular, exactly
  # L: achieved (both leaves) L Lᵀ − A to 9.8e-8, 3.4e-8 and 5.4e-8 (‖A‖ = 1), and 1.6e-9, 1.6e-10
  # and 7.5e-10 x cond relative to L (cond 1e2, 1e4, 1e3).
  assert np.abs(L @ np.swapaxes(L, 1, 2) - A).max() <= 3e-7
  assert np.linalg.norm(L - L_ref) <= 5e-9 * cond * np.linalg.norm(L_ref)
  # Achieved (both leaves) 4.5e-9, 3.0e-9 and 4.8e-9 x cond relative (cond 1e2, 1e4, 1e3), and
  # X A Xᵀ − I to 9.0e-9, 3.9e-9 and 7.4e-9 x cond: float32 rounding of A amplified by cond.
  assert np.linalg.norm(X - X_ref) <= 1e-8 * cond * np.linalg.norm(X_ref)
  assert np.abs(X @ A @ np.swapaxes(X, 1, 2) - np.eye(n)).max() <= 2e-8 * cond


def test_kernel_and_fallback_agree_to_rounding():
  A = jnp.asarray(_spd(4, 64, 10.0, seed=1), jnp.float32)
  for pallas, xla in zip(jax.jit(LEAVES["pallas"])(A), jax.jit(LEAVES["xla"])(A)):
    np.testing.assert_allclose(pallas, xla, atol=1e-6)  # reached: 4.8e-7 (one fused multiply-add apart)


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_not_positive_definite_gives_nan_in_that_matrix_only(leaf):
  A = _spd(2, 16, 10.0)
  A[1, 5, 5] = -1.0
  _, X = jax.jit(LEAVES[leaf])(jnp.asarray(A, jnp.float32))
  assert np.isfinite(X[0]).all() and np.isnan(X[1]).any()


def test_sizes_the_kernel_does_not_take():
  for n in (12, 256):
    with pytest.raises(ValueError, match="power of two"):
      cholesky.cholesky_and_inverse(jnp.eye(n)[None], interpret=True)


@pytest.mark.parametrize("n", [16, 128])
def test_lowers_for_cuda_as_one_launch_for_the_batch(n, h100):
  """One Triton module for the whole batch; a vmap adds a grid axis, not a launch."""
  f = jax.vmap(lambda A: cholesky.cholesky_and_inverse(A, interpret=False))
  lowered = jax.jit(f).trace(jax.ShapeDtypeStruct((2, 36, n, n), jnp.float32)).lower(lowering_platforms=("cuda",))
  assert len(parse_triton_modules(lowered)) == 1
  text = lowered.as_text()
  assert text.count("custom_call") == 1 and "grid_x = 36" in text and "grid_y = 2" in text
