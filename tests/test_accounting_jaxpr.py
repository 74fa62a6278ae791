"""Primitive counts and matmul flops of traced programs: calls followed, scans unrolled,
while loops reported apart, a Pallas kernel counted as one launch."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from dion_jax import accounting


def test_scans_count_per_iteration_and_jitted_calls_are_followed():
  inner = jax.jit(lambda x: x @ x)

  def f(x):
    y = jax.lax.scan(lambda c, _: (inner(c), None), x, length=5)[0]
    return jnp.linalg.cholesky(y @ y.T)

  program = jax.make_jaxpr(f)(jnp.ones((8, 8)))
  per_run, in_while = accounting.primitive_counts(program)
  assert per_run["dot_general"] == 6 and per_run["cholesky"] == 1 and not in_while
  assert accounting.matmul_flops(program) == 6 * 2 * 8**3


def test_while_loops_are_apart_and_refused_for_flops():
  def f(x):
    return jax.lax.while_loop(lambda c: c[0, 0] < 10.0, lambda c: c @ c, x)

  program = jax.make_jaxpr(f)(jnp.ones((4, 4)))
  per_run, in_while = accounting.primitive_counts(program)
  assert in_while["dot_general"] == 1 and per_run["dot_general"] == 0
  with pytest.raises(ValueError, match="while"):
    accounting.matmul_flops(program)


def test_a_pallas_kernel_is_one_launch():
  def kernel(x_ref, o_ref):
    o_ref[...] = jax.lax.fori_loop(0, 3, lambda i, a: a @ a, x_ref[...])

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), interpret=True)
  per_run, _ = accounting.primitive_counts(jax.make_jaxpr(jax.vmap(call))(jnp.ones((2, 16, 16))))
  assert per_run["pallas_call"] == 1 and per_run["dot_general"] == 0
