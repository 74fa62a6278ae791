"""scale_by_dion as an optax transformation: state dtypes and bad input."""

import jax.numpy as jnp
import pytest

import dion_jax


def test_momentum_and_q_dtypes():
  tx = dion_jax.scale_by_dion(momentum_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, backend="xla")
  params = {"w": jnp.ones((16, 8), jnp.float32)}
  state = tx.init(params)
  assert state.momentum["w"].dtype == jnp.bfloat16 and state.q["w"].dtype == jnp.bfloat16
  upd, state = tx.update({"w": jnp.ones((16, 8)) * 0.1}, state, params)
  assert upd["w"].dtype == jnp.float32
  assert state.momentum["w"].dtype == jnp.bfloat16 and state.q["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(rank_fraction=0.0), "rank_fraction"),
        (dict(rank_fraction=1.5), "rank_fraction"),
        (dict(mu=-0.1), "mu"),
        (dict(qr_method="svd"), "qr_method"),
        (dict(power_iters=0), "power_iters"),
        (dict(scale_rule="bogus"), "scale_rule"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_hyperparameters(kwargs, word):
  with pytest.raises(ValueError, match=word):
    dion_jax.scale_by_dion(**kwargs)


def test_vector_labelled_dion_is_an_error():
  tx = dion_jax.scale_by_dion()
  with pytest.raises(ValueError, match=r"\['b'\].*shape \(8,\)"):
    tx.init({"b": jnp.ones(8)})
