"""FP8 products (models/fp8.py) against float64 NumPy with an independent FP8 rounding
(ml_dtypes'), and the FP8 GPT on meshes against one device."""
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


def test_flags_name_the_model_recipes():
  assert flags.FP8_RECIPES == fp8.RECIPES
  assert models.GPTConfig(fp8=True).fp8 == "current" and models.GPTConfig(fp8=False).fp8 == "none"
  with pytest.raises(ValueError, match="GPTConfig.fp8 must be one of"):
    models.GPTConfig(fp8="delayed")


CFG = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=16, fp8="current")


def _batch():
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, CFG.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


@pytest.fixture(scope="module")
def reference():
  return model_meshes.one_device(CFG, _batch())


def test_fp8_changes_the_loss_by_its_rounding(reference):
  """The FP8 model is not the float32 one: its loss differs by FP8's rounding (a few
  thousandths of the ~6.4 loss here), not more."""
  _, want, _ = model_meshes.one_device(models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=16), _batch())
  assert 1e-5 < abs(reference[1] - want) / want < 1e-2


def test_the_scale_is_the_whole_tensors_amax_in_every_shard_map():
  """Inside a shard_map manual over rp, cp and pp, a tensor's amax is maxed over the
  replicas and cp (shards of one tensor), not over pp (each stage its own layers')."""
  mesh = model_meshes.mesh("rp=2,cp=2,pp=2")
  x = np.random.default_rng(0).normal(size=(2, 2, 2, 3)).astype(np.float32)
  spec = jax.sharding.PartitionSpec("pp", "rp", "cp")
  got = jax.jit(jax.shard_map(lambda x: fp8.amax(x)[None], mesh=mesh, in_specs=spec,
                              out_specs=jax.sharding.PartitionSpec("pp")))(x)
  np.testing.assert_array_equal(got, np.abs(x).max(axis=(1, 2, 3)))


# The same arithmetic on a mesh rounds its float32 parts (norms, softmax, sums over tp)
# in another order, and now and then an operand lands on the neighbouring FP8 value: the
# loss moves by ~2e-5 (measured on these meshes), a gradient by a few percent of its
# norm (an e5m2 step is 12.5-25% of the element, and the backward pass carries it down).
# Without the maxima over rp and cp (each shard its own scale) the loss moves 1.3e-4 (cp)
# to 4.9e-4 (rp): the test above holds those maxima exactly.
# One mesh of the batch axes, Dion's replicas and tp (the trainer's test runs pp,
# tests/test_train_gpt.py): ~7 s of compiling each.
@pytest.mark.parametrize("spec,options", [("rp=2,fs=2,tp=2", {"sequence_parallel": True})])
def test_mesh_matches_one_device(reference, spec, options):
  """Loss and gradients (Dion's per-replica ones averaged on rp) of the FP8 model on a
  mesh against one device, within the FP8 roundings that float32 differences flip."""
  graphdef, want_loss, want_grads = reference
  par = models.Parallelism(model_meshes.mesh(spec), **options)
  _, params = models.init(CFG, par)
  loss, grads = model_meshes.loss_and_grads(graphdef, params, _batch(), par)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
  for got, want in zip(jax.tree.leaves(model_meshes.in_layer_order(grads, par)), jax.tree.leaves(want_grads)):
    assert np.linalg.norm(np.asarray(got) - want) <= 0.1 * np.linalg.norm(want)
