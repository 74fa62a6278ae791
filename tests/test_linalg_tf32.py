"""TF32 arithmetic of float32 matmuls: the rounding, the three-product split against
float64 NumPy, and XLA's own dot algorithm when traced as on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion_jax.linalg import tf32


def test_tf32_rounding_is_round_to_nearest_even_on_11_significant_bits():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=100_000) * 10.0 ** rng.integers(-30, 30, 100_000)).astype(np.float32)
  mantissa, exponent = np.frexp(x.astype(np.float64))
  expected = np.ldexp(np.round(np.ldexp(mantissa, 11)), exponent - 11).astype(np.float32)  # numpy rounds half to even
  np.testing.assert_array_equal(tf32.round_to_tf32(jnp.asarray(x)), expected)


def test_split_keeps_22_significant_bits():
  """hi and lo are TF32 numbers, and hi + lo is x to 2⁻²² of it, two roundings to 11 bits
  (reached: 2⁻²³; hi alone 2⁻¹¹)."""
  x = np.random.default_rng(1).normal(size=10_000).astype(np.float32)
  hi, lo = (np.asarray(v, np.float64) for v in tf32.split(jnp.asarray(x)))
  np.testing.assert_array_equal(tf32.round_to_tf32(jnp.asarray(lo, jnp.float32)), lo.astype(np.float32))
  assert np.all(np.abs(x - hi) <= 2.0**-11 * np.abs(x))  # one TF32 rounding
  assert np.all(np.abs(x - hi - lo) <= 2.0**-22 * np.abs(x))


@pytest.mark.parametrize("precision", tf32.PRECISIONS)
def test_einsum_is_float32_accurate(precision):
  """Against float64 NumPy (reached: 5.8e-7 for both, relative to the largest entry), where
  a single TF32 product misses by 3e-4: the low parts are summed, not dropped."""
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(3, 64, 300)), rng.normal(size=(3, 300, 50))
  ref = np.einsum("bij,bjk->bik", a, b)
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  out = np.asarray(tf32.einsum("bij,bjk->bik", a32, b32, precision), np.float64)
  assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-6
  one_product = jnp.einsum("bij,bjk->bik", tf32.round_to_tf32(a32), tf32.round_to_tf32(b32), precision="highest")
  assert np.abs(np.asarray(one_product, np.float64) - ref).max() / np.abs(ref).max() > 1e-4


@pytest.mark.parametrize("precision,marker", [
    ("float32", "precision = [HIGHEST, HIGHEST]"),
    ("tensorfloat32x3", "lhs_precision_type = tf32, rhs_precision_type = tf32, accumulation_type = f32, "
                        "lhs_component_count = 1, rhs_component_count = 1, num_primitive_operations = 3")])
def test_as_on_a_gpu_one_dot_of_xlas_algorithm(monkeypatch, precision, marker):
  """Traced as on a GPU: one dot_general carrying the algorithm, no emulated rounding (XLA:GPU
  splits the operands itself)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # read when traced
  f = lambda a, b: tf32.einsum("ij,jk->ik", a, b, precision)  # noqa: E731
  text = jax.jit(f).trace(jnp.zeros((8, 16)), jnp.zeros((16, 4))).lower(lowering_platforms=("cuda",)).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 1 and marker in dots[0], dots
  assert "bitcast_convert" not in text


def test_unknown_precision():
  with pytest.raises(ValueError, match="precision='tensorfloat32' is not supported"):
    tf32.einsum("ij,jk->ik", jnp.ones((2, 2)), jnp.ones((2, 2)), "tensorfloat32")
