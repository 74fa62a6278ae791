"""The train step's loss is the mean over counted targets (not -1) of the whole global batch,
exactly, whatever the micro-batches and replicas see of them."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion_jax
import models
from tests import model_meshes
from train.run import step as step_lib

CFG = models.preset("tiny", num_layers=2, d_model=32, num_heads=2, seq_len=8, mlp="swiglu", num_kv_heads=1)


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, (8, CFG.seq_len + 1)).astype(np.int32)
  targets = tokens[:, 1:].copy()
  # uneven masks: one row entirely ignored, others partly
  keep = rng.random(targets.shape) < np.linspace(0.0, 1.0, 8)[:, None]
  targets[~keep] = -1
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(targets)}


def _replica_mean_sgd(lr, per_replica):
  """SGD on the replicas' mean gradient, like Dion's view of per-replica gradients."""

  def update(grads, state, params=None):
    del params
    mean = jax.tree.map(lambda g, rep: g.mean(0) if rep else g, grads, per_replica)
    return jax.tree.map(lambda g: -lr * g, mean), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("spec,accum,replicas", [
    ("rp=2,fs=2", 2, True),  # Dion's per-replica gradients
    ("rp=2,fs=2", 2, False),  # every gradient averaged over rp once, after the micro-batches
    ("fs=2,pp=2", 1, False),
])
def test_masked_mean_is_exact_over_micro_batches_and_replicas(spec, accum, replicas):
  batch = _batch()
  graphdef, params = models.init(CFG, seed=0)
  want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch)))(params)
  counted = np.asarray(batch["targets"]) >= 0
  logits_free = jax.jit(lambda p, b: models.loss(graphdef, p, b))(
      params, {**batch, "targets": jnp.where(counted, batch["targets"], 0)})
  assert abs(float(want_loss) - float(logits_free)) > 1e-3  # the mask matters

  sizes = dion_jax.parse_mesh_spec(spec)
  mesh = dion_jax.make_mesh(spec, jax.devices()[:int(np.prod(list(sizes.values())))])
  par = models.Parallelism(mesh, microbatches=2 if sizes["pp"] > 1 else 1)
  with jax.set_mesh(mesh):
    _, mesh_params = models.init(CFG, par, seed=0)
    per_replica = jax.tree.map(lambda x: x.ndim >= 4, mesh_params) if replicas else None
    tx = _replica_mean_sgd(1.0, per_replica) if replicas else optax.sgd(1.0)
    train_step = step_lib.make_train_step(graphdef, par, tx, optax.constant_schedule(1.0), per_replica,
                                          accum, clip_grad=0.0)
    state = step_lib.TrainState(mesh_params, tx.init(mesh_params), jnp.zeros((), jnp.int32),
                                step_lib.initial_loss_scale(1.0))
    before = jax.tree.map(np.asarray, mesh_params)  # the step donates its state
    new, metrics = train_step(state, batch)
  assert float(metrics.loss) == pytest.approx(float(want_loss), rel=1e-6)
  moved = jax.tree.map(lambda a, b: a - np.asarray(b), before, new.params)
  moved = dict(moved, blocks=models.to_layers(moved["blocks"], par.pp))
  want = dict(want_grads, blocks=models.to_layers(want_grads["blocks"], 1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), atol=1e-6, rtol=1e-4), moved, want)


def test_gradient_clipping_against_the_float64_norm():
  """The logged norm is the float64 global norm of the gradients (measured: 1.8e-8
  relative), and --clip-grad at half of it halves the SGD step."""
  batch = _batch()
  graphdef, params = models.init(CFG, seed=0)
  grads = jax.jit(jax.grad(lambda p: models.loss(graphdef, p, batch)))(params)
  norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
  mesh = dion_jax.make_mesh("fs=1", jax.devices()[:1])
  with jax.set_mesh(mesh):
    _, mesh_params = models.init(CFG, models.Parallelism(mesh), seed=0)
    tx = optax.sgd(1.0)
    train_step = step_lib.make_train_step(graphdef, models.Parallelism(mesh), tx,
                                          optax.constant_schedule(1.0), None, 1, clip_grad=norm / 2)
    before = jax.tree.map(np.asarray, mesh_params)  # the step donates its state
    state = step_lib.TrainState(mesh_params, tx.init(mesh_params), jnp.zeros((), jnp.int32),
                                step_lib.initial_loss_scale(1.0))
    new, metrics = train_step(state, batch)
  assert float(metrics.grad_norm) == pytest.approx(norm, rel=2e-7)
  jax.tree.map(lambda b, a, g: np.testing.assert_allclose(b - a, 0.5 * np.asarray(g), rtol=1e-4, atol=1e-7),
               before, jax.tree.map(np.asarray, new.params), grads)


def test_replicas_reduce_gradients_once_per_step():
  """Gradient accumulation sums unreduced gradients on each replica: the rp all-reduce
  runs once per step (loop bodies counted per iteration), and carries one gradient
  shard: the parameters' bytes per device, and the loss."""
  cfg = models.preset("tiny", num_layers=2, d_model=64, num_heads=2, seq_len=16)
  mesh = model_meshes.mesh("rp=2,fs=2,tp=2")
  par = models.Parallelism(mesh)
  graphdef, params = models.abstract(cfg, par)
  batch = {k: jax.ShapeDtypeStruct((16, cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}

  def bytes_over_rp(accum):
    with jax.set_mesh(mesh):
      compiled = jax.jit(step_lib.make_gradient(graphdef, par, None, accum)).lower(params, batch).compile()
    stats = dion_jax.collective_stats(compiled, mesh, trip_counts=True)
    return sum(s.bytes for s in stats if "rp" in s.axes)

  shard = sum(4 * np.prod(p.sharding.shard_shape(p.shape)) for p in jax.tree.leaves(params))
  once = bytes_over_rp(1)
  # Besides the shard, five float32 scalars (20 bytes: the loss, the targets' count, the aux's).
  assert shard <= once <= shard + 32
  assert bytes_over_rp(4) == once


def test_an_offloaded_optimizer_state_lives_in_pinned_host_memory_between_steps():
  """``--offload-optimizer``'s step: Dion's state enters and leaves the compiled step in
  pinned host memory (its shardings, kept), the parameters on the device; in the program
  JAX builds for CUDA every state array moves to the device for the update and back (XLA:CPU
  lowers those moves to nothing)."""
  from jax import export

  from train.run import config as config_lib
  from train.run import trainer
  cfg = config_lib.parse(["--offload-optimizer", "--global-batch-size", "8", "--dion-rank-fraction", "0.5"])
  mesh = model_meshes.mesh("rp=2,fs=2")  # Dion's per-replica momentum and its sharded Q
  par, accum = trainer.parallelism(cfg, mesh)
  with jax.set_mesh(mesh):
    graphdef, params = models.init(CFG, par)
    state, train_step = trainer.make_trainer(cfg, CFG, graphdef, params, par, accum)
    batch = jax.device_put(_batch(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(models.BATCH_AXES)))
    compiled = train_step.lower(state, batch).compile()
    exported = export.export(train_step, platforms=("cuda",))(state, batch).mlir_module()
  kinds = lambda tree: {s.memory_kind for s in jax.tree.leaves(tree)}  # noqa: E731
  live = jax.tree.map(lambda x: x.sharding, state)
  assert kinds(live.opt_state) == {"pinned_host"} and kinds(live.params) == {"device"}
  (state_in, _), _ = compiled.input_shardings
  state_out, _ = compiled.output_shardings
  for shardings in (state_in, state_out):
    assert kinds(shardings.opt_state) == {"pinned_host"} and kinds(shardings.params) == {"device"}
  arrays = len(jax.tree.leaves(state.opt_state))
  assert exported.count('_xla_buffer_placement = "device"') == arrays
  assert exported.count('_xla_buffer_placement = "pinned_host"') == arrays
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a.spec == b.spec, state_out.opt_state, live.opt_state)))
