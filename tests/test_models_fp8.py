"""FP8 products (models/fp8.py) against float64 NumPy with an independent FP8 rounding
(ml_dtypes'), and their scales on every mesh. The FP8 trainer on meshes against one device:
tests/test_train_gpt.py; its CUDA program: tests/test_train_run_cuda_lowering.py."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import models
from models import fp8
from tests import model_meshes
from train.run import flags

# Unit roundoffs: e4m3 keeps 3 mantissa bits, e5m2 2; below the smallest normal the
# spacing is that of the subnormals, 2^-9 (e4m3) and 2^-16 (e5m2).
E4M3 = (ml_dtypes.float8_e4m3fn, 448.0, 2.0**-4, 2.0**-10)
E5M2 = (ml_dtypes.float8_e5m2, 57344.0, 2.0**-3, 2.0**-17)


def np_quantized(v, kind, scaled=True):
  """``(q·s in float64, the bound on each element's error |q·s − v|)``: s = amax/max."""
  dtype, largest, unit, subnormal = kind
  s = np.max(np.abs(v)) / largest if scaled else 1.0
  q = np.clip(v / s, -largest, largest).astype(dtype).astype(np.float64) * s
  return q, unit * np.abs(v) + subnormal * s


def bound(a, da, b, db, contract):
  """Bound on the error of the product of a and b (over ``contract``) from elementwise
  errors da, db: |a|·db + da·|b| + da·db, plus float32 accumulation (K·2^-24 of |a||b|)."""
  dot = lambda u, v: np.tensordot(u, v, contract)  # noqa: E731
  return dot(np.abs(a), db) + dot(da, np.abs(b)) + dot(da, db) + a.shape[contract[0][0]] * 2.0**-24 * dot(np.abs(a), np.abs(b))


def _inputs():
  """Inputs far outside e4m3's range unscaled: x up to ~4000 (e4m3's largest is 448),
  w around 1e-3 (its smallest normal is 2^-6 = 0.016)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 8, 64)) * 1000
  w = rng.normal(size=(64, 48)) * 1e-3
  g = rng.normal(size=(4, 8, 48)) * 1e4
  return x.astype(np.float32).astype(np.float64), w.astype(np.float32).astype(np.float64), g.astype(np.float32).astype(np.float64)


def test_product_and_its_gradients_err_as_fp8_rounding_allows():
  """y = x w, dx = g wᵀ, dw = xᵀ g against the exact float64 products: within the bound
  the e4m3 (e5m2 for g) roundings of the scaled operands allow, elementwise; and the
  float64 product of ml_dtypes' roundings equals them up to float32 accumulation. The
  same inputs cast without their scales break that bound (clipped x, w flushed to zero)."""
  x, w, g = _inputs()
  y, vjp = jax.vjp(fp8.matmul, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
  dx, dw = vjp(jnp.asarray(g, jnp.float32))
  (qx, ex), (qw, ew), (qg, eg) = np_quantized(x, E4M3), np_quantized(w, E4M3), np_quantized(g, E5M2)
  cases = {"y": (y, x, ex, w, ew, ((2,), (0,)), qx, qw),
           "dx": (dx, g, eg, w, ew, ((2,), (1,)), qg, qw),
           "dw": (dw, x, ex, g, eg, ((0, 1), (0, 1)), qx, qg)}
  for name, (got, a, da, b, db, contract, qa, qb) in cases.items():
    got = np.asarray(got, np.float64)
    exact, allowed = np.tensordot(a, b, contract), bound(a, da, b, db, contract)
    assert np.all(np.abs(got - exact) <= allowed), name
    # The same rounding as ml_dtypes': float32 accumulation of the exact FP8 products.
    rounded = np.tensordot(qa, qb, contract)
    accumulation = 2.0**-20 * np.tensordot(np.abs(qa), np.abs(qb), contract)
    assert np.all(np.abs(got - rounded) <= accumulation), name
    # And the rounding is FP8's: a few percent of the result (e4m3: 2^-4 per operand).
    assert 1e-3 < np.max(np.abs(got - exact)) / np.max(np.abs(exact)) < 0.1, name
  unscaled_x, _ = np_quantized(x, E4M3, scaled=False)
  unscaled_w, _ = np_quantized(w, E4M3, scaled=False)
  assert np.any(np.abs(unscaled_x @ unscaled_w - x @ w) > bound(x, ex, w, ew, ((2,), (0,))))


def test_an_overflow_stays_non_finite():
  """An inf in the input or the output's gradient (a float16 overflow) makes the product
  or the gradients non-finite, as without FP8, not clipped to FP8's largest value: the
  step's guard and loss scaling see it."""
  x, w = jnp.ones((2, 4), jnp.float16), jnp.ones((4, 3), jnp.float32)
  assert not np.isfinite(np.asarray(fp8.matmul(x.at[0, 0].set(jnp.inf), w))).any()
  y, vjp = jax.vjp(fp8.matmul, x, w)
  dx, dw = vjp(jnp.ones_like(y).at[1, 2].set(jnp.inf))
  assert np.isfinite(np.asarray(y)).all() and not np.isfinite(np.asarray(dx)).all() and not np.isfinite(np.asarray(dw)).all()


def test_flags_name_the_model_recipes():
  assert flags.FP8_RECIPES == fp8.RECIPES
  assert models.GPTConfig(fp8=True).fp8 == "current" and models.GPTConfig(fp8=False).fp8 == "none"
  with pytest.raises(ValueError, match="GPTConfig.fp8 must be one of"):
    models.GPTConfig(fp8="delayed")


def test_the_scale_is_the_whole_tensors_amax_in_every_shard_map():
  """Inside a shard_map manual over rp, cp and pp, a tensor's amax is maxed over the
  replicas and cp (shards of one tensor), not over pp (each stage its own layers'). (Each
  shard its own scale would move a 2-layer model's loss by 1.3e-4 on cp=2, 4.9e-4 on rp=2.)"""
  mesh = model_meshes.mesh("rp=2,cp=2,pp=2")
  x = np.random.default_rng(0).normal(size=(2, 2, 2, 3)).astype(np.float32)
  spec = jax.sharding.PartitionSpec("pp", "rp", "cp")
  got = jax.jit(jax.shard_map(lambda x: fp8.amax(x)[None], mesh=mesh, in_specs=spec,
                              out_specs=jax.sharding.PartitionSpec("pp")))(x)
  np.testing.assert_array_equal(got, np.abs(x).max(axis=(1, 2, 3)))
