"""The blocked inverse Cholesky factor of a batch of Grams: against float64 NumPy, on a mesh,
and lowered for CUDA as a few batched launches with no cuSOLVER or cuBLAS factorization."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dion_jax.linalg import cholesky
from tests import stablehlo_calls
from tests.triton_ir import parse_triton_modules


def _gram(batch, r, cond, seed=0):
  """float64 (batch, r, r) Grams of m x r matrices with singular values logspaced 1 .. 1/cond."""
  rng = np.random.default_rng(seed)
  U = np.linalg.qr(rng.normal(size=(batch, 2 * r, r)))[0]
  V = np.linalg.qr(rng.normal(size=(batch, r, r)))[0]
  A = (U * np.logspace(0, -np.log10(cond), r)) @ np.swapaxes(V, 1, 2)
  return np.swapaxes(A, 1, 2) @ A


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("r", [40, 200, 384])  # one block of 64, two of 128 (padded), three of 128
def test_inverse_factor_matches_float64(backend, r):
  G = _gram(2, r, 30.0, seed=r)
  W = np.asarray(jax.jit(lambda g: cholesky.inverse_cholesky(g, backend=backend))(jnp.asarray(G, jnp.float32)),
                 np.float64)
  W_ref = np.linalg.inv(np.swapaxes(np.linalg.cholesky(G), 1, 2))
  assert np.array_equal(np.tril(W, -1), np.zeros_like(W))  # upper triangular, exactly
  # Achieved (both leaves): 3.4e-6 (r = 40), 6.1e-6 (200), 7.7e-6 (384): float32 rounding of G times
  # its condition 900 (1.4e-5 and 2.1e-5 at 200 and 384 before L₂₁'s refinement).
  assert np.linalg.norm(W - W_ref) <= 2e-5 * np.linalg.norm(W_ref)
  assert np.abs(np.swapaxes(W, 1, 2) @ G @ W - np.eye(r)).max() < 5e-5  # achieved 1.6e-5 (6.5e-5 before)


# The Gram, shift included, that the first shifted pass factored for a 768 x 384 P of Dion's
# first step on ``small``'s width with 2 layers (seed 0, the embedded corpus): P had 71
# singular values from 2.4 down to 1.2e-3, then float32 noise from 1.5e-7; the Gram's
# condition is 1.0e7. Float32, its upper triangle (numpy.triu_indices order).
FIRST_STEP_GRAM = pathlib.Path(__file__).parent / "fixtures" / "dion_first_step_gram.npz"


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_shifted_gram_from_training_factors_as_lapack_does(backend):
  """Without the refinement of L₂₁ the Schur complement of this Gram was not positive
  definite: NaN from the second block on, where LAPACK's factor is finite."""
  upper = np.load(FIRST_STEP_GRAM)["upper"]
  r = 384
  G = np.zeros((r, r), np.float32)
  G[np.triu_indices(r)] = upper
  G = G + np.triu(G, 1).T
  W = np.asarray(jax.jit(lambda g: cholesky.inverse_cholesky(g, backend=backend))(jnp.asarray(G)[None]), np.float64)[0]
  assert np.isfinite(W).all()
  G64 = G.astype(np.float64)
  # float32 at condition 1e7 leaves O(1) here: LAPACK's factor (potrf, then its triangular
  # inverse) reached 0.42, this one 0.46 (xla) and 0.42 (pallas); float64's 8e-10.
  assert np.linalg.norm(W.T @ G64 @ W - np.eye(r), 2) < 0.6


def test_blocks_are_powers_of_two_up_to_128():
  assert [cholesky.block_size(r) for r in (1, 16, 17, 40, 128, 129, 768)] == [16, 16, 32, 64, 128, 128, 128]


def test_not_positive_definite_gives_nan():
  G = _gram(2, 200, 10.0)
  G[1, 150, 150] = -1.0  # in the second block: the recursion carries it there
  W = np.asarray(cholesky.inverse_cholesky(jnp.asarray(G, jnp.float32), backend="xla"))
  assert np.isfinite(W[0]).all() and np.isnan(W[1]).any()


def test_inside_shard_map_on_mesh_varying_grams():
  """Grams that vary over a mesh axis (each device its own batch) inside shard_map with
  the vma checks on: the XLA leaf's loop carries what the Grams vary over."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("fs",))
  G = jnp.asarray(_gram(4, 40, 10.0), jnp.float32)
  f = jax.shard_map(lambda g: cholesky.inverse_cholesky(g, backend="xla"), mesh=mesh, in_specs=P("fs"),
                    out_specs=P("fs"))
  one_device = jax.jit(lambda g: cholesky.inverse_cholesky(g, backend="xla"))(G)
  np.testing.assert_allclose(jax.jit(f)(G), one_device, atol=2e-6)  # reached 5.1e-7: batches of 2 and 4 round apart


@pytest.mark.parametrize("r,blocks", [(40, 1), (384, 3), (768, 6)])
def test_lowered_for_cuda_as_batched_launches(monkeypatch, r, blocks, h100):
  """As on a GPU (``"auto"``: the Pallas leaf): one Triton launch per diagonal block for
  the whole batch, 6 matmuls per further block, no cuSOLVER, no triangular solve, no loop."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  G = jax.ShapeDtypeStruct((36, r, r), jnp.float32)
  lowered = jax.jit(cholesky.inverse_cholesky).trace(G).lower(lowering_platforms=("cuda",))
  assert len(parse_triton_modules(lowered)) == blocks
  reached = stablehlo_calls.reached_ops(lowered)
  assert {x.op for x in reached} <= {"__gpu$xla.gpu.triton"}, reached
  text = lowered.as_text()
  assert text.count("stablehlo.dot_general") == 6 * (blocks - 1)
  assert "stablehlo.while" not in text
