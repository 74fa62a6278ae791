"""The Pallas Newton–Schulz kernels: interpreter numerics against XLA, and CUDA lowering on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion_jax.kernels import newton_schulz, newton_schulz_xla
from dion_jax.linalg import polar
from tests.triton_ir import parse_triton_modules


def _x(shape, dtype, seed=0):
  X = np.random.default_rng(seed).normal(size=shape) / np.sqrt(shape[-1])
  return jnp.asarray(X, dtype)


@pytest.mark.parametrize("s,l", [(40, 72), (128, 96), (130, 200)])
def test_symmetric_products_match_float64(s, l):
  X = _x((2, s, l), jnp.float32)
  got = newton_schulz.symmetric_products(X, -4.775, 2.0315, interpret=True)
  X64 = np.asarray(X, np.float64)
  A = X64 @ np.swapaxes(X64, 1, 2)
  want = -4.775 * A + 2.0315 * A @ A
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert np.array_equal(np.asarray(got), np.swapaxes(np.asarray(got), 1, 2))  # Mirrored exactly.


def test_bf16_products_match_xla():
  X = _x((1, 96, 160), jnp.bfloat16, seed=1)
  got = np.asarray(newton_schulz.symmetric_products(X, 1.5, -0.5, interpret=True), np.float32)
  want = np.asarray(newton_schulz_xla.xla_symmetric_products(X, 1.5, -0.5), np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


# The rescaled method's later steps are these products too (tests/test_linalg_polar.py).
@pytest.mark.parametrize("method", ["polar_express", "newton_schulz"])
def test_polar_with_kernels_equals_xla(method):
  G = _x((3, 48, 80), jnp.float32, seed=2)
  pallas = polar.polar_factor(G, method=method, dtype=jnp.float32, backend="pallas")
  xla = polar.polar_factor(G, method=method, dtype=jnp.float32, backend="xla")
  np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), atol=2e-5)


def test_upper_tiles_halve_the_flops():
  counts = newton_schulz.counted_flops(1024, 4096)
  assert counts["pallas"] <= 0.54 * counts["xla"]  # 16·17/2 of 16² tiles of A and of B: 0.53.


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_for_cuda(dtype, h100):
  X = jax.ShapeDtypeStruct((2, 256, 1024), dtype)
  f = lambda x: newton_schulz.symmetric_products(x, 3.4, -4.7, interpret=False)
  modules = parse_triton_modules(jax.jit(f).trace(X).lower(lowering_platforms=("cuda",)))
  assert len(modules) == 2 and all("scf.for" in m for m in modules)
