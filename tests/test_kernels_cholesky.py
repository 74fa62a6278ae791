"""The inverse-Cholesky leaf: the Pallas kernel (interpreted) and its XLA twin against float64
NumPy, and the kernel lowered for CUDA on CPU as one Triton module per batch."""

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


def _inverse_factor_f64(A):
  return np.linalg.inv(np.linalg.cholesky(A))


LEAVES = {"xla": cholesky_xla.xla_inverse_cholesky,
          "pallas": lambda A: cholesky.inverse_cholesky(A, interpret=True)}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
@pytest.mark.parametrize("n,cond", [(16, 1e2), (64, 1e4), (128, 1e3)])
def test_inverse_factor_matches_float64(leaf, n, cond):
  A = _spd(3, n, cond, seed=n)
  X = np.asarray(jax.jit(LEAVES[leaf])(jnp.asarray(A, jnp.float32)), np.float64)
  X_ref = _inverse_factor_f64(A)
  assert np.array_equal(np.triu(X, 1), np.zeros_like(X))  # lower triangular, exactly
  # Achieved (both leaves) 4.5e-9, 3.0e-9 and 4.8e-9 x cond relative (cond 1e2, 1e4, 1e3), and
  # X A Xᵀ − I to 9.0e-9, 3.9e-9 and 7.4e-9 x cond: float32 rounding of A amplified by cond.
  assert np.linalg.norm(X - X_ref) <= 1e-8 * cond * np.linalg.norm(X_ref)
  assert np.abs(X @ A @ np.swapaxes(X, 1, 2) - np.eye(n)).max() <= 2e-8 * cond


def test_kernel_and_fallback_agree_to_rounding():
  A = jnp.asarray(_spd(4, 64, 10.0, seed=1), jnp.float32)
  X_pallas = jax.jit(LEAVES["pallas"])(A)
  X_xla = jax.jit(LEAVES["xla"])(A)
  np.testing.assert_allclose(X_pallas, X_xla, atol=1e-6)  # reached: 4.8e-7 (one fused multiply-add apart)


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_not_positive_definite_gives_nan_in_that_matrix_only(leaf):
  A = _spd(2, 16, 10.0)
  A[1, 5, 5] = -1.0
  X = np.asarray(jax.jit(LEAVES[leaf])(jnp.asarray(A, jnp.float32)))
  assert np.isfinite(X[0]).all() and np.isnan(X[1]).any()


def test_sizes_the_kernel_does_not_take():
  for n in (12, 256):
    with pytest.raises(ValueError, match="power of two"):
      cholesky.inverse_cholesky(jnp.eye(n)[None], interpret=True)


@pytest.mark.parametrize("n", [16, 128])
def test_lowers_for_cuda_as_one_launch_for_the_batch(n, h100):
  """One Triton module for the whole batch; a vmap adds a grid axis, not a launch."""
  f = jax.vmap(lambda A: cholesky.inverse_cholesky(A, interpret=False))
  lowered = jax.jit(f).trace(jax.ShapeDtypeStruct((2, 36, n, n), jnp.float32)).lower(lowering_platforms=("cuda",))
  assert len(parse_triton_modules(lowered)) == 1
  text = lowered.as_text()
  assert text.count("custom_call") == 1 and "grid_x = 36" in text and "grid_y = 2" in text
