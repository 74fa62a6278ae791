"""FP8 products (models/fp8.py), dense and the experts' grouped ones, against float64
NumPy with an independent FP8 rounding (ml_dtypes'), their scales on every mesh, and the
FP8 model on meshes against one device. The FP8 trainer on meshes against one device:
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


def np_quantized(v, kind, scaled=True, per_expert=False):
  """``(q·s in float64, the bound on each element's error |q·s − v|)``: s = amax/max (with
  ``per_expert``, each v[g]'s own)."""
  dtype, largest, unit, subnormal = kind
  axes = tuple(range(1, v.ndim)) if per_expert else None
  s = np.max(np.abs(v), axis=axes, keepdims=per_expert) / largest if scaled else 1.0
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


def _experts_inputs():
  """``(x [10, 64], g [10, 48], w [3, 64, 48], group sizes, each grouped row's expert)``:
  experts 5·10^5 apart in magnitude, expert 1's group empty, two rows past the groups."""
  x, _, g = _inputs()
  w = np.random.default_rng(1).normal(size=(3, 64, 48)).astype(np.float32).astype(np.float64)
  sizes = [3, 0, 5]
  return (x.reshape(-1, 64)[:10], g.reshape(-1, 48)[:10], w * np.array([1e-3, 1.0, 500.0])[:, None, None], sizes,
          np.repeat(np.arange(3), sizes))


def _grouped_products(group):
  """NumPy's grouped products for rows of experts ``group``: ``(grouped, kernels)``,
  ``grouped(a, b_GxKxN)`` each row times its expert's kernel (rows past the groups give
  zeros), ``kernels(a, b)`` each expert's rows' aᵀb."""
  def grouped(a, b_GxKxN):
    rows = [a[i] @ b_GxKxN[k] for i, k in enumerate(group)]
    return np.stack(rows + [np.zeros_like(rows[0])] * (len(a) - len(group)))

  def kernels(a, b):
    return np.stack([a[: len(group)][group == k].T @ b[: len(group)][group == k] for k in range(3)])

  return grouped, kernels


def test_grouped_product_and_its_gradients_err_as_fp8_rounding_allows():
  """The experts' grouped product (rows of group g times kernel g; one group empty, two
  rows past the groups) and both gradients: equal up to float32 accumulation to the
  float64 products of ml_dtypes' roundings with the scale of the whole rows and each
  expert's own kernel scale, and within FP8's error of the exact products, each expert's
  rows on their own: experts 5·10^5 apart in magnitude (one scale for all the kernels
  flushes the small expert's weights below e4m3's subnormals: its rows' error is 100%)."""
  x, g, w, sizes, group = _experts_inputs()
  y, vjp = jax.vjp(lambda a, b: fp8.grouped_matmul(a, b, jnp.asarray(sizes, jnp.int32)),
                   jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
  dx, dw = (np.asarray(d, np.float64) for d in vjp(jnp.asarray(g, jnp.float32)))
  (qx, _), (qw, _), (qg, _) = np_quantized(x, E4M3), np_quantized(w, E4M3, per_expert=True), np_quantized(g, E5M2)

  grouped, kernels = _grouped_products(group)

  want = {"y": (grouped(qx, qw), grouped(np.abs(qx), np.abs(qw)), grouped(x, w)),
          "dx": (grouped(qg, qw.swapaxes(1, 2)), grouped(np.abs(qg), np.abs(qw).swapaxes(1, 2)),
                 grouped(g, w.swapaxes(1, 2))),
          "dw": (kernels(qx, qg), kernels(np.abs(qx), np.abs(qg)), kernels(x, g))}
  for name, got in (("y", np.asarray(y, np.float64)), ("dx", dx), ("dw", dw)):
    rounded, magnitude, exact = want[name]
    assert np.all(np.abs(got - rounded) <= 2.0**-20 * magnitude), name
    # Each expert on its own: its kernel's gradient (dw), or its rows (y, dx); expert 1 has none.
    for k in (0, 2):
      got_k, exact_k = (got[k], exact[k]) if name == "dw" else (got[: len(group)][group == k],
                                                                exact[: len(group)][group == k])
      assert 1e-3 < np.max(np.abs(got_k - exact_k)) / np.max(np.abs(exact_k)) < 0.1, (name, k)
  assert np.all(dw[1] == 0) and np.all(np.asarray(y)[len(group):] == 0)


def test_grouped_products_lower_for_cuda_on_fp8_operands():
  """Lowered for CUDA, the grouped product and its two gradients are three ragged dots on
  FP8 operands with float32 results: e4m3 x e4m3 (y), e5m2 x e4m3 (dx), e4m3 x e5m2 (dw)."""
  shapes = (jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((4, 32, 16), jnp.float32),
            jax.ShapeDtypeStruct((4,), jnp.int32))
  loss = lambda x, w, sizes: jnp.sum(fp8.grouped_matmul(x, w, sizes).astype(jnp.float32))  # noqa: E731
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  dots = [line.rsplit(":", 1)[1] for line in text.splitlines() if "chlo.ragged_dot" in line]
  assert sorted(dots) == sorted([
      " (tensor<64x32xf8E4M3FN>, tensor<4x32x16xf8E4M3FN>, tensor<4xi32>) -> tensor<64x16xf32>",
      " (tensor<64x16xf8E5M2>, tensor<4x32x16xf8E4M3FN>, tensor<4xi32>) -> tensor<64x32xf32>",
      " (tensor<64x32xf8E4M3FN>, tensor<64x16xf8E5M2>, tensor<4xi32>) -> tensor<4x32x16xf32>"])


def test_delayed_product_scales_by_its_history_and_returns_the_amaxes():
  """fp8.delayed_matmul with a given history: x, w and g each cast with the scale of its
  history's largest amax (x's history 3x its amax, w's 0.5x: w saturates at 448, g's the
  newest column 0 zero, its max in a middle column), against the float64 product of
  ml_dtypes' roundings with those scales, up to float32 accumulation (2^-20 of the product
  of magnitudes; current scaling's own scales leave it by a few percent). The history's
  cotangent is the three tensors' own amaxes in column 0, zeros elsewhere."""
  x, w, g = _inputs()
  amaxes = [np.max(np.abs(v)) for v in (x, w, g)]
  history = np.zeros((3, fp8.HISTORY), np.float32)
  history[0, [0, 5]] = amaxes[0] * np.array([1.0, 3.0])
  history[1, 0] = amaxes[1] * 0.5
  history[2, [7, 9]] = amaxes[2] * np.array([1.25, 2.0])
  scales = history.max(axis=1).astype(np.float64) / np.array([448.0, 448.0, 57344.0])
  y, vjp = jax.vjp(fp8.delayed_matmul, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(history))
  dx, dw, dh = vjp(jnp.asarray(g, jnp.float32))
  qx, qw, qg = (np.clip(v / s, -m, m).astype(d).astype(np.float64) * s
                for v, s, m, d in ((x, scales[0], 448.0, ml_dtypes.float8_e4m3fn), (w, scales[1], 448.0, ml_dtypes.float8_e4m3fn),
                                   (g, scales[2], 57344.0, ml_dtypes.float8_e5m2)))
  assert np.any(np.abs(w) > 0.5 * amaxes[1]) and np.max(np.abs(qw)) == pytest.approx(0.5 * amaxes[1], rel=1e-6)  # saturated
  for name, got, a, b, contract in (("y", y, qx, qw, ((2,), (0,))), ("dx", dx, qg, qw, ((2,), (1,))),
                                    ("dw", dw, qx, qg, ((0, 1), (0, 1)))):
    rounded = np.tensordot(a, b, contract)
    accumulation = 2.0**-20 * np.tensordot(np.abs(a), np.abs(b), contract)
    assert np.all(np.abs(np.asarray(got, np.float64) - rounded) <= accumulation), name
  expected = np.zeros_like(history)
  expected[:, 0] = amaxes
  np.testing.assert_allclose(dh, expected, rtol=1e-7)  # float32's rounding of the float64 amaxes
  rolled = np.asarray(fp8.updated_history(history, np.asarray(dh)[:, 0]))
  np.testing.assert_allclose(rolled[:, 0], amaxes, rtol=1e-7)  # this step's amaxes, in front
  # The older entries move one column on, unchanged (a move, no arithmetic: exact).
  np.testing.assert_array_equal(rolled[:, [4, 6, 8]], history[:, [5, 7, 9]])


def test_delayed_grouped_product_scales_by_its_histories_and_returns_the_amaxes():
  """fp8.delayed_grouped_matmul with given histories (experts 5·10^5 apart in magnitude,
  one group empty, two rows past the groups): the rows cast with the scale of their
  history (2x their amax; the same in every expert's), the gradient with its (1.5x), each
  expert's kernel with its own (expert 0's 1x its amax, expert 1's empty: its own amax,
  expert 2's 0.5x: saturates), against the float64 products of ml_dtypes' roundings with
  those scales, up to float32 accumulation; the histories' cotangent is each expert's
  rows', kernel's and gradient's amaxes in column 0 (the rows' and gradient's whole)."""
  x, g, w, sizes, group = _experts_inputs()
  m_x, m_w, m_g = np.max(np.abs(x)), np.max(np.abs(w), axis=(1, 2)), np.max(np.abs(g))
  history = np.zeros((3, 3, fp8.HISTORY), np.float32)
  history[:, 0, 4], history[:, 2, 0] = 2 * m_x, 1.5 * m_g
  history[0, 1, 0], history[2, 1, 3] = m_w[0], 0.5 * m_w[2]
  s_x, s_g = 2 * m_x / 448.0, 1.5 * m_g / 57344.0
  s_w = np.array([m_w[0], m_w[1], 0.5 * m_w[2]]) / 448.0
  y, vjp = jax.vjp(lambda a, b, h: fp8.delayed_grouped_matmul(a, b, jnp.asarray(sizes, jnp.int32), h),
                   jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(history))
  dx, dw, dh = (np.asarray(d, np.float64) for d in vjp(jnp.asarray(g, jnp.float32)))
  qx, qg = (np.clip(v / s, -m, m).astype(d).astype(np.float64) * s
            for v, s, m, d in ((x, s_x, 448.0, ml_dtypes.float8_e4m3fn), (g, s_g, 57344.0, ml_dtypes.float8_e5m2)))
  qw = np.clip(w / s_w[:, None, None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s_w[:, None, None]
  assert np.max(np.abs(qw[2])) == pytest.approx(0.5 * m_w[2], rel=1e-6)  # saturated

  grouped, kernels = _grouped_products(group)

  for name, got, product, a, b in (("y", y, grouped, qx, qw), ("dx", dx, grouped, qg, qw.swapaxes(1, 2)),
                                   ("dw", dw, kernels, qx, qg)):
    accumulation = 2.0**-20 * product(np.abs(a), np.abs(b))
    assert np.all(np.abs(np.asarray(got, np.float64) - product(a, b)) <= accumulation), name
  expected = np.zeros_like(history)
  expected[:, :, 0] = np.stack([np.full(3, m_x), m_w, np.full(3, m_g)], axis=1)
  np.testing.assert_allclose(dh, expected, rtol=1e-7)  # float32's rounding of the float64 amaxes


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
    models.GPTConfig(fp8="bogus")


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


# --- the FP8 model on every mesh kind gives one device's loss and gradients -------------

CFG = models.preset("tiny", num_layers=2, d_model=32, num_heads=2, seq_len=16, fp8="current")


def _batch():
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, CFG.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def _one_device(microbatches):
  """One device's loss and gradients, each of ``microbatches`` micro-batches (rows i,
  i + M, ..., as the pipeline splits them) quantized with its own scales, as on pp."""
  graphdef, params = models.init(CFG)
  batch = _batch()
  count, sequences = jnp.float32(batch["targets"].size), jnp.float32(batch["targets"].shape[0])

  def loss(p):
    return sum(models.loss(graphdef, p, jax.tree.map(lambda x, i=i: x[i::microbatches], batch), denominator=count,
                           sequences=sequences) for i in range(microbatches))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return graphdef, float(value), model_meshes.in_layer_order(grads, models.Parallelism())


def test_fp8_model_on_cp_and_pp_matches_one_device():
  """cp=2,pp=2 with two micro-batches: cp splits every sequence inside the model's
  shard_map (each amax maxed over cp), pp the layers, micro-batch by micro-batch (each
  its own scales, as on one device). Measured relative errors: <= 5e-7 (loss and every
  gradient); each shard its own scale (the amax not maxed over cp) gives 0.17."""
  model_meshes.assert_mesh_matches(_one_device(2), CFG, _batch(), "cp=2,pp=2", {"microbatches": 2}, rtol=1e-5)


_QUANTIZE = fp8.quantize


def _quantized(monkeypatch, run):
  """``(input, FP8 values, scale)`` of every tensor ``fp8.quantize`` casts in ``run()``'s
  program, float32 NumPy, whole tensors (the partitioner's sharding gathered)."""
  seen = []

  def recording(x, dtype):
    q, s = _QUANTIZE(x, dtype)
    jax.debug.callback(lambda *a: seen.append([np.asarray(v) for v in a]), x.astype(jnp.float32),
                       q.astype(jnp.float32), s)
    return q, s

  monkeypatch.setattr(fp8, "quantize", recording)
  run()
  jax.effects_barrier()
  return seen


def test_fp8_on_tp_and_fs_scales_whole_tensors(monkeypatch):
  """On fs=2,tp=2 every tensor of the forward and backward pass is cast with the scale of
  the whole tensor, amax/max of its gathered values in NumPy (to an ulp), to ml_dtypes'
  rounding of it; the loss is one device's (measured: equal). The gradients are not
  compared: this batch's backward pass has two of its ~3e5 values a float32 rounding
  apart from one device's on the two sides of a tie between two FP8 values, and each
  such jump of one FP8 step (1/8 to 1/4 of the value) moves the gradients below it,
  attn/out's by 7e-3 here (docs/fp8.md); cp and pp, above, have none."""
  graphdef, params = models.init(CFG)
  batch = _batch()
  want = float(models.loss(graphdef, params, batch))
  par = models.Parallelism(model_meshes.mesh("fs=2,tp=2"))
  with jax.set_mesh(par.mesh):
    params = models.init(CFG, par)[1]
    step = jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch, par)))
    out = []
    seen = _quantized(monkeypatch, lambda: out.append(step(params)))
  loss = float(out[0][0])
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert len(seen) == 60  # 6 products x 2 layers x (x and w forward, again recomputed, g)
  for x, q, s in seen:
    kind = E5M2 if np.max(np.abs(q)) > 448 else E4M3  # e5m2's largest is 57344
    dtype, largest = kind[:2]
    np.testing.assert_allclose(s, np.max(np.abs(x)) / largest, rtol=2.5e-7)
    np.testing.assert_array_equal(q, np.clip(x / s, -largest, largest).astype(dtype).astype(np.float32))


def test_fp8_experts_on_fs_ep_tp_match_one_device():
  """A mixture of experts with its grouped products in FP8 on fs=2,ep=2,tp=2 (rows
  exchanged over ep, each expert's F split over tp, the rows' amax maxed over the
  dispatch's manual axes, each expert's kernel amax over tp but not ep): one device's loss
  and gradients (the experts' scales maxed over ep too: 1.4e-3 off)."""
  cfg = models.preset("tiny-moe", num_layers=2, d_model=32, num_heads=2, seq_len=16, mlp_dim=32, num_experts=4,
                      fp8="current")
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  model_meshes.assert_mesh_matches(model_meshes.one_device(cfg, batch), cfg, batch, "fs=2,ep=2,tp=2", {}, rtol=1e-5)
