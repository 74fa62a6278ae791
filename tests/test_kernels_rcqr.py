"""The Pallas RCQR kernels: interpreter numerics against the XLA passes, and CUDA lowering on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from dion_jax.kernels import rcqr as pallas_rcqr
from dion_jax.kernels import rcqr_xla, sketch
from dion_jax.linalg import qr
from tests.triton_ir import parse_triton_modules

# (m, r, dtype): non-aligned rows and columns; r = 130 takes the unfused solve + Gram path.
SHAPES = [(100, 8, jnp.float32), (77, 20, jnp.bfloat16), (300, 130, jnp.float32)]


def _matrix(m, r, cond, dtype, seed=0):
  """m x r with singular values spaced geometrically from 1 to 1/cond."""
  rng = np.random.default_rng(seed)
  U = np.linalg.qr(rng.standard_normal((m, r)))[0]
  V = np.linalg.qr(rng.standard_normal((r, r)))[0]
  return jnp.asarray((U * np.geomspace(1.0, 1.0 / cond, r)) @ V.T, dtype)


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _assert_orthonormal_same_span(Q, Q_ref, P):
  """Q is orthonormal, spans P, and spans what Q_ref spans as closely as float32 allows.

  For condition 1e5, float32 fixes the span of P's weakest directions only to about
  eps·1e5 ≈ 1e-2, so the distance to Q_ref is bounded by the distance between two
  reference methods (XLA RCQR and Householder QR) on the same P.
  """
  r = Q.shape[-1]
  P = P.astype(jnp.float32)
  assert float(jnp.linalg.norm(Q.T @ Q - jnp.eye(r))) < 1e-5
  assert _rel(Q @ (Q.T @ P), P) < 2e-6

  def distance(A, B):  # ‖A Aᵀ B − B‖: how far B's columns are from A's span
    return float(jnp.linalg.norm(A @ (A.T @ B) - B))

  householder = jnp.linalg.qr(P)[0]
  assert distance(Q, Q_ref) <= 2 * distance(Q_ref, householder) + 1e-5


@pytest.mark.parametrize("m,r,dtype", SHAPES)
def test_passes_match_xla(m, r, dtype):
  P = _matrix(m, r, 1e3, dtype)
  seed, row_start = jnp.uint32(11), jnp.uint32(37)
  k = sketch.sketch_size(r, 1.25)
  SP = pallas_rcqr.sketch_product(P, seed, k, row_start, interpret=True)
  SP_ref = rcqr_xla.xla_sketch_product(P, seed, k, row_start)
  assert SP.shape == (k, r) and SP.dtype == jnp.float32
  assert _rel(SP, SP_ref) < 1e-6

  R1 = jnp.linalg.qr(SP_ref, mode="r")
  P1, G = pallas_rcqr.solve_and_gram(P, R1, interpret=True)
  P1_ref, G_ref = rcqr_xla.xla_solve_and_gram(P, R1)
  assert P1.dtype == G.dtype == jnp.float32
  assert _rel(P1, P1_ref) < 1e-4 and _rel(G, G_ref) < 1e-4
  assert _rel(G, G.T) < 1e-7  # symmetric up to the matmul's summation order (0 here)

  R2 = jnp.linalg.cholesky(G_ref).T
  assert _rel(pallas_rcqr.solve(P1_ref, R2, interpret=True), rcqr_xla.xla_solve(P1_ref, R2)) < 1e-5


@pytest.mark.parametrize("m,r,dtype", [(300, 24, jnp.float32), (257, 130, jnp.float32), (200, 16, jnp.bfloat16)])
def test_rcqr_ill_conditioned(m, r, dtype):
  P = _matrix(m, r, 1e5, jnp.float32, seed=1).astype(dtype)
  Q = qr.rcqr(P, jnp.uint32(5), backend="pallas")  # interprets on CPU
  Q_ref = qr.rcqr(P, jnp.uint32(5), backend="xla")
  assert Q.shape == (m, r) and Q.dtype == jnp.float32
  _assert_orthonormal_same_span(Q, Q_ref, P)


def test_vmap_stacked_matrices_and_seeds():
  m, r = 90, 12
  P = jnp.stack([jnp.stack([_matrix(m, r, 1e5, jnp.float32, seed=3 * i + j) for j in range(3)]) for i in range(2)])
  seeds = jnp.arange(6, dtype=jnp.uint32).reshape(2, 3)
  rcqr = functools.partial(qr.rcqr, backend="pallas")
  Q = jax.jit(jax.vmap(jax.vmap(rcqr)))(P, seeds)
  for i in range(2):
    for j in range(3):
      Q_ref = qr.rcqr(P[i, j], seeds[i, j], backend="xla")
      _assert_orthonormal_same_span(Q[i, j], Q_ref, P[i, j])
  # A batched kernel gives each matrix exactly what the unbatched kernel gives it.
  k = sketch.sketch_size(r, 1.25)
  SP = jax.vmap(lambda p, s: pallas_rcqr.sketch_product(p, s, k, jnp.uint32(0), interpret=True))(P[0], seeds[0])
  # (Up to float32 rounding: on CPU the interpreted kernel is compiled twice; 0 here.)
  assert _rel(SP[2], pallas_rcqr.sketch_product(P[0, 2], seeds[0, 2], k, jnp.uint32(0), interpret=True)) < 1e-6


@pytest.mark.parametrize("m,r,dtype", [(1000, 8, jnp.bfloat16), (65536, 1024, jnp.float32)])
def test_kernels_lower_for_cuda(m, r, dtype, h100):
  P = jax.ShapeDtypeStruct((2, m, r), dtype)
  R = jax.ShapeDtypeStruct((2, r, r), jnp.float32)
  k = sketch.sketch_size(r, 1.25)
  passes = {
      "sketch_product": (lambda p: pallas_rcqr.sketch_product(p, jnp.uint32(1), k, jnp.uint32(0), interpret=False), (P,)),
      "solve_and_gram": (functools.partial(pallas_rcqr.solve_and_gram, interpret=False), (P, R)),
      "solve": (functools.partial(pallas_rcqr.solve, interpret=False), (P, R)),
  }
  for name, (f, args) in passes.items():
    modules = parse_triton_modules(jax.jit(jax.vmap(f)).trace(*args).lower(lowering_platforms=("cuda",)))
    assert len(modules) >= 1, name


def test_row_sharded_rcqr_under_shard_map(h100):
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  P = _matrix(200, 16, 1e5, jnp.float32, seed=4)

  def sharded(backend, check_vma):
    f = functools.partial(qr.rcqr, seed=jnp.uint32(3), axis_name="tp", backend=backend)
    spec = PartitionSpec("tp")
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))

  # jax 0.10's Pallas interpreter rejects mesh-varying inputs: interpret with check_vma=False.
  Q = sharded("pallas", check_vma=False)(P)
  _assert_orthonormal_same_span(Q, sharded("xla", check_vma=True)(P), P)

  def compiled_passes(P_mxr):  # the GPU kernels, which do accept check_vma=True
    row_start = jax.lax.axis_index("tp").astype(jnp.uint32) * jnp.uint32(P_mxr.shape[0])
    SP = pallas_rcqr.sketch_product(P_mxr, jnp.uint32(3), 128, row_start, interpret=False)
    P1, G = pallas_rcqr.solve_and_gram(P_mxr, jnp.triu(SP[:16]), interpret=False)
    return pallas_rcqr.solve(P1, jnp.eye(16) + jax.lax.psum(G, "tp"), interpret=False)

  spec = PartitionSpec("tp")
  f = jax.jit(jax.shard_map(compiled_passes, mesh=mesh, in_specs=spec, out_specs=spec))
  assert "triton" in f.trace(P).lower(lowering_platforms=("cuda",)).as_text()
