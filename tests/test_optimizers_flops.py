"""The flop formulas of ``dion_jax.optimizers.flops`` against independent counts: every matrix
product in each optimizer's traced step (loops counted by their trip counts), and XLA's cost
analysis for AdamW's elementwise update."""

import jax
import jax.numpy as jnp
import optax
import pytest

import dion_jax
from dion_jax import accounting
from dion_jax.optimizers import flops

# Flax layout (fan_in, fan_out): a stack of two squares, a wide and a tall kernel, and one whose
# rank-1 P (320 x 160) takes the blocked inverse Cholesky's recursion (two blocks of 128).
PARAMS = {"a": jnp.zeros((2, 96, 96)), "b": jnp.zeros((96, 384)), "c": jnp.zeros((384, 96)),
          "d": jnp.zeros((160, 320))}
SHAPES = [(96, 96), (96, 96), (96, 384), (384, 96), (160, 320)]


def _traced_matmul_flops(tx) -> int:
  return accounting.matmul_flops(jax.make_jaxpr(tx.update)(PARAMS, tx.init(PARAMS), PARAMS))


_ALL_DION = lambda params: jax.tree.map(lambda _: "dion", params)  # noqa: E731


@pytest.mark.parametrize("qr_method", ["shifted_cqr", "cqr", "polar", "rcqr", "qr"])
@pytest.mark.parametrize("rank_fraction", [1.0, 0.5])
def test_dion_matmuls_are_the_traced_step_s(qr_method, rank_fraction):
  tx = dion_jax.dion(0.01, rank_fraction=rank_fraction, qr_method=qr_method, labels=_ALL_DION, backend="xla")
  counted = flops.step_flops("dion", SHAPES, rank_fraction=rank_fraction, qr_method=qr_method)
  assert counted["matmul"] == _traced_matmul_flops(tx)


@pytest.mark.parametrize("optimizer", ["muon", "dion2"])
def test_family_matmuls_are_the_traced_step_s(optimizer):
  tx = getattr(dion_jax, optimizer)(0.01, labels=_ALL_DION)
  assert flops.step_flops(optimizer, SHAPES)["matmul"] == _traced_matmul_flops(tx)


def test_adamw_is_xla_s_cost_analysis():
  tx = optax.adamw(1e-3)
  params = {"w": jnp.zeros((256, 128))}

  def step(g, state, p):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  cost = jax.jit(step).lower(params, tx.init(params), params).compile().cost_analysis()
  counted = flops.step_flops("adamw", [(256, 128)])["elementwise"]
  assert abs(cost["flops"] - counted) <= 16  # the step count and bias corrections: scalars


def test_small_matrix_set():
  """``small``'s 72 matrices: Muon's five Polar Express steps about 1.6 TFLOP, Dion at rank
  1/2 about a third of that."""
  shapes = [(768, 768)] * 48 + [(768, 3072)] * 12 + [(3072, 768)] * 12
  muon = flops.step_flops("muon", shapes)["total"]
  dion = flops.step_flops("dion", shapes, rank_fraction=0.5)["total"]
  assert muon == 48 * (20 * 768**3 + 10 * 768**3) + 24 * (20 * 768**2 * 3072 + 10 * 768**3)
  assert 0.3 < dion / muon < 0.35
  with pytest.raises(ValueError, match="optimizer"):
    flops.step_flops("sgd", shapes)
