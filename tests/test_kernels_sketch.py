"""The counter-based random sketch of RCQR: distribution, determinism, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion_jax.kernels import rcqr_xla, sketch

K, M_ROWS = 128, 4096


def _S(seed, row_start=0, rows=M_ROWS, k=K):
  return np.asarray(sketch.sketch_block(jnp.uint32(seed), jnp.uint32(row_start), rows, k), np.float64)


@pytest.mark.parametrize("r, oversample, k", [(64, 1.25, 128), (128, 1.25, 256), (100, 1.0, 128), (1, 1.25, 128)])
def test_sketch_size(r, oversample, k):
  assert sketch.sketch_size(r, oversample) == k


def _byte_sum_law():
  """Exact law of the standardized sum of four uniform bytes: values z and probabilities."""
  pmf = np.ones(256) / 256
  for _ in range(3):
    pmf = np.convolve(pmf, np.ones(256) / 256)
  values = np.arange(pmf.size, dtype=np.float64)
  mean = (values * pmf).sum()
  std = np.sqrt(((values - mean) ** 2 * pmf).sum())
  return (values - mean) / std, pmf


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_entries_have_variance_one_over_k_and_near_gaussian_law(seed):
  S = _S(seed)
  n = S.size  # 524288 samples
  assert S.shape == (K, M_ROWS)
  assert abs(S.mean()) < 5 / np.sqrt(K * n)  # 5 standard errors
  assert abs(S.var() * K - 1) < 0.02  # the standard error of the variance is ~0.002
  z = S * np.sqrt(K)
  law_z, law_p = _byte_sum_law()
  for c in (0.5, 1, 2, 3):
    assert abs(np.mean(np.abs(z) < c) - law_p[np.abs(law_z) < c].sum()) < 0.005, c
  assert abs(np.mean(np.abs(z) < 1) - 0.6827) < 0.02  # and close to a Gaussian's
  assert abs(np.mean(z**4) - 2.7) < 0.05  # Irwin-Hall(4) kurtosis: 3 - 6/(5·4)
  assert np.max(np.abs(z)) <= np.abs(law_z).max() + 1e-6


def test_rows_are_uncorrelated():
  S = _S(3) * np.sqrt(K)
  C = S @ S.T / M_ROWS  # ~ I, off-diagonal entries ~ N(0, 1 / M_ROWS)
  off = C[~np.eye(K, dtype=bool)]
  assert np.max(np.abs(off)) < 6 / np.sqrt(M_ROWS)
  assert abs(np.std(off) * np.sqrt(M_ROWS) - 1) < 0.1
  # and neighbouring columns (rows of P) too
  assert abs(np.mean(S[:, :-1] * S[:, 1:])) < 5 / np.sqrt(S.size)


def test_same_seed_same_sketch_other_seed_other_sketch():
  np.testing.assert_array_equal(_S(7), _S(7))
  jitted = jax.jit(sketch.sketch_block, static_argnums=(2, 3))
  np.testing.assert_array_equal(np.asarray(jitted(jnp.uint32(7), jnp.uint32(0), M_ROWS, K), np.float64), _S(7))
  a, b = _S(7).ravel(), _S(8).ravel()
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.01


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_tp_split_reproduces_column_blocks(shards):
  """Shard i of the rows of P builds columns [i·m/tp, (i+1)·m/tp) of the global S."""
  m = 512
  S_global = _S(21, rows=m)
  blocks = [_S(21, row_start=i * m // shards, rows=m // shards) for i in range(shards)]
  np.testing.assert_array_equal(np.concatenate(blocks, axis=1), S_global)


def test_sketch_product_is_the_same_under_any_row_split():
  rng = np.random.default_rng(0)
  P_mxr = jnp.asarray(rng.normal(size=(512, 32)), jnp.float32)
  full = rcqr_xla.xla_sketch_product(P_mxr, jnp.uint32(4), K, jnp.uint32(0))
  parts = sum(
      rcqr_xla.xla_sketch_product(P_mxr[i * 128 : (i + 1) * 128], jnp.uint32(4), K, jnp.uint32(i * 128))
      for i in range(4)
  )
  np.testing.assert_allclose(parts, full, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(full, _S(4, rows=512).astype(np.float32) @ np.asarray(P_mxr), rtol=1e-4, atol=1e-4)


def test_step_seeds_differ_across_steps_and_base_seeds():
  seeds = {int(sketch.mix_seed(base, step)) for base in range(16) for step in range(64)}
  assert len(seeds) == 16 * 64
  assert int(sketch.mix_seed(3, 7)) == int(sketch.mix_seed(3, jnp.int32(7)))
  batch = sketch.mix_seed(5, jnp.arange(4, dtype=jnp.uint32))
  assert batch.shape == (4,) and len(set(np.asarray(batch).tolist())) == 4
