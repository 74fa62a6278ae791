"""The circular pipeline schedule against sequential composition, and its compute overhead."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dion_jax
import models
from models import pipeline


@pytest.mark.parametrize("pp,virtual_stages,num_micro", [(2, 1, 3), (2, 2, 4), (4, 2, 8), (4, 1, 4)])
def test_circular_schedule_composes_stages_in_order(pp, virtual_stages, num_micro):
  stages = pp * virtual_stages
  # Stage s maps x -> a_s·x + s: composition order shows in the result (a_s differ).
  a = np.arange(2, stages + 2, dtype=np.float32)
  x = np.arange(num_micro, dtype=np.float32)[:, None] + 1
  want = x.copy()
  for s in range(stages):
    want = a[s] * want + s
  perm = models.to_stages({"a": a[:, None], "b": np.arange(stages, dtype=np.float32)[:, None]}, pp, virtual_stages)
  stage_params = jax.tree.map(lambda t: t[:, 0], perm)  # [stages], device j holds its v stages
  mesh = dion_jax.make_mesh(f"pp={pp}", jax.devices()[:pp])

  def local(params, x):
    # aux: the stage each iteration ran (p["b"] = s), against iteration_repeats' account.
    out, stage_I = pipeline.circular(lambda p, x, i: (p["a"] * x + p["b"], p["b"]), params, lambda i: x[i],
                                     num_micro, pp, virtual_stages)
    repeat_I, active_I = pipeline.iteration_repeats(num_micro, pp, virtual_stages)
    return out[None], stage_I[None], repeat_I[None], active_I[None]

  got, stage, repeat, active = jax.shard_map(local, mesh=mesh, in_specs=(P("pp"), P()), out_specs=P("pp"))(
      stage_params, jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got)[-1], want)  # the last device holds the outputs
  for j in range(pp):  # device j runs stage r·pp + j of repeat r, num_micro times each
    busy = np.asarray(active[j])
    np.testing.assert_array_equal(np.asarray(stage[j])[busy, 0], np.asarray(repeat[j])[busy] * pp + j)
    assert np.bincount(np.asarray(repeat[j])[busy], minlength=virtual_stages).tolist() == [num_micro] * virtual_stages


def test_to_stages_round_trip_and_circular_placement():
  layers = np.arange(8)
  stacked = models.to_stages(layers, pp=2, virtual_stages=2)
  # Device 0 holds execution stages 0 and 2, device 1 stages 1 and 3 (two layers each).
  np.testing.assert_array_equal(stacked, [[0, 1], [4, 5], [2, 3], [6, 7]])
  np.testing.assert_array_equal(models.to_layers(stacked, 2, 2), layers)
  with pytest.raises(ValueError, match="do not split into 4 pipeline stages"):
    models.to_stages(np.arange(6), pp=2, virtual_stages=2)


def test_compiled_overhead_is_the_bubble():
  cfg = models.preset("tiny", num_layers=4, d_model=32, num_heads=2, seq_len=8, unroll=True)
  tokens = jnp.zeros((8, cfg.seq_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}

  def flops(par):
    graphdef, params = models.init(cfg, par)
    with jax.set_mesh(par.mesh):
      fn = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par)))
      return fn.lower(params, batch).compile().cost_analysis()["flops"]

  base = flops(models.Parallelism(dion_jax.make_mesh("pp=1", jax.devices()[:1])))
  pp, v, M = 2, 2, 4
  piped = flops(models.Parallelism(dion_jax.make_mesh("pp=2", jax.devices()[:2]), microbatches=M, virtual_stages=v))
  bubble = (pp - 1) / (M * v + pp - 1)
  # Each device runs every iteration of the schedule: the overhead is the bubble, no more.
  assert pp * piped / base == pytest.approx(1 / (1 - bubble), rel=0.02)
