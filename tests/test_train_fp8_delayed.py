"""--fp8 delayed in the trainer (train/run/step.py, trainer.py, the checkpoint): a step's
amaxes are the max over its micro-batches, a mesh trains as one device, the histories resume
bit for bit and stay out of the optimizer's state. The product itself: tests/test_models_fp8.py."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np

import models
from tests import model_meshes
from tests.test_train_gpt import assert_trees_equal, compile_cache, saved_state, train, train_losses  # noqa: F401
from train import gpt
from train.run import step as step_lib


def test_a_steps_amaxes_are_the_max_over_its_micro_batches():
  """The trainer's gradient over two micro-batches gives each history the max of the two
  micro-batches' amaxes (each from its own gradient of the loss, the global mean's share),
  not their sum (which flax's overwrite-with-gradient gives with float32 histories): on one
  device (micro-batches accumulated by the step) and on cp=2,pp=2 with two virtual stages
  (the micro-batches inside the pipeline's schedule, whose idle iterations add no amax;
  each amax maxed over cp's parts of the sequence, not summed)."""
  cfg = models.GPTConfig(vocab_size=64, num_layers=4, d_model=32, num_heads=2, seq_len=16, fp8="delayed")
  graphdef, full = models.init(cfg)
  params, histories = models.fp8.split_state(full)
  tokens = np.random.default_rng(0).integers(0, 64, (4, 17))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  gradient = step_lib.make_gradient(graphdef, models.Parallelism(), None, accum=2)
  _, (_, amaxes) = jax.jit(gradient)(params, batch, None, histories)

  par = models.Parallelism(model_meshes.mesh("cp=2,pp=2"), microbatches=2, virtual_stages=2)
  mesh_params, mesh_histories = models.fp8.split_state(models.init(cfg, par)[1])
  with jax.set_mesh(par.mesh):
    _, (_, mesh_amaxes) = jax.jit(step_lib.make_gradient(graphdef, par, None, accum=1))(
        mesh_params, batch, None, mesh_histories)
  mesh_amaxes = model_meshes.in_layer_order(mesh_amaxes, par)

  @jax.jit
  def micro_amaxes(micro):
    loss = lambda h: models.loss(graphdef, models.fp8.joined(params, h), micro,  # noqa: E731
                                 denominator=jnp.float32(batch["targets"].size))
    return jax.tree.map(lambda a: a[..., 0], jax.grad(loss)(histories))

  # step_lib.split_micro's (and the pipeline's) micro-batch i: rows i, i + 2.
  first, second = (micro_amaxes({k: v[rows] for k, v in batch.items()}) for rows in (np.array([0, 2]), np.array([1, 3])))
  for got, on_mesh, a, b in zip(jax.tree.leaves(amaxes), jax.tree.leaves(mesh_amaxes), jax.tree.leaves(first),
                                jax.tree.leaves(second)):
    assert not np.allclose(a, b, rtol=1e-3)  # the two micro-batches' amaxes differ
    np.testing.assert_allclose(got[..., 0], np.maximum(a, b), rtol=1e-6)  # measured: equal (another program)
    np.testing.assert_allclose(on_mesh.reshape(got.shape)[..., 0], np.maximum(a, b), rtol=1e-6)  # measured: 1.6e-7
    assert not np.any(got[..., 1:]) and not np.any(on_mesh[..., 1:])


def test_delayed_on_a_mesh_matches_one_device_resumes_and_stays_out_of_the_optimizer(compile_cache, tmp_path, capsys):
  """--fp8 delayed, AdamW, 3 steps of two micro-batches: on rp=2,cp=2,pp=2 (each replica's
  amaxes maxed over the replicas, its gradient's in one device's units; the micro-batches in
  the pipeline, the sequence split over cp) the losses and the saved histories are one
  device's within float32 rounding (measured: losses equal to 7 digits, histories 5e-7; on
  rp=2,fs=2,tp=2 too, 1e-6, which the suite no longer runs for its time: fs and tp shard
  the products' tensors, whose amaxes test_experts_on_a_mesh_... checks on fs=2,ep=2,tp=2);
  one device's run resumed from its step-2 checkpoint saves the same step-3 state bit for
  bit; the optimizer's state holds no history, the saved ``fp8`` one per product; and that
  checkpoint refuses another --fp8 recipe in one line."""
  common = ("--fp8", "delayed", "--optimizer", "adamw", "--steps", "3")
  assert train(tmp_path / "one", *common, "--mesh", "fs=1", "--micro-batch-size", "4", "--save-every", "2") == 0
  assert train(tmp_path / "pipeline", *common, "--mesh", "rp=2,cp=2,pp=2", "--micro-batch-size", "2") == 0
  one = list(train_losses(tmp_path / "one").values())
  assert len(one) == 3
  np.testing.assert_allclose(list(train_losses(tmp_path / "pipeline").values()), one, rtol=1e-5)
  state = saved_state(tmp_path / "one")
  histories = {jax.tree_util.keystr(p): h for p, h in jax.tree_util.tree_leaves_with_path(state["fp8"])}
  assert len(histories) == 6 and all(h.shape == (2, 3, models.fp8.HISTORY) for h in histories.values())
  assert all(np.all(h[..., [0, -2, -1]] > 0) and not np.any(h[..., 1:-2]) for h in histories.values())  # 3 steps
  for h, m in zip(jax.tree.leaves(state["fp8"]), jax.tree.leaves(saved_state(tmp_path / "pipeline")["fp8"])):
    np.testing.assert_allclose(m, h, rtol=1e-5)
  for tree in ("opt_state", "params"):
    assert not any("fp8" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state[tree]))

  shutil.copytree(tmp_path / "one", tmp_path / "resumed")
  assert gpt.main(["--run-dir", str(tmp_path / "resumed"), "--resume", "--step", "2", "--steps", "3"]) == 0
  assert_trees_equal(saved_state(tmp_path / "resumed"), state)
  capsys.readouterr()
  assert gpt.main(["--run-dir", str(tmp_path / "resumed"), "--resume", "--fp8", "current", "--steps", "4"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: the checkpoint in") and "--fp8 delayed" in err and err.count("\n") == 1


def test_experts_on_a_mesh_give_one_devices_amaxes_and_gradients():
  """A mixture of experts (its grouped products with per-expert kernel histories) and
  histories that set the scales (1.3x a first step's amaxes), two micro-batches: on
  fs=2,ep=2,tp=2 (rows exchanged over ep, each expert's kernel amax maxed over tp, not ep)
  the step's amaxes and gradients are one device's (measured: amaxes 1e-10, gradients 4e-7)."""
  cfg = models.preset("tiny-moe", num_layers=2, d_model=32, num_heads=2, seq_len=16, mlp_dim=32, num_experts=4,
                      fp8="delayed")
  graphdef, full = models.init(cfg)
  params, histories = models.fp8.split_state(full)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  gradient = jax.jit(step_lib.make_gradient(graphdef, models.Parallelism(), None, accum=2))
  first = gradient(params, batch, None, histories)[1][1]
  histories = jax.tree.map(lambda h, a: models.fp8.updated_history(h, 1.3 * a[..., 0]), histories, first)
  _, (grads, amaxes) = gradient(params, batch, None, histories)
  assert jax.tree.leaves(amaxes)[-1].shape == (1, 2, 4, 2, 3, models.fp8.HISTORY)  # each expert's, each kernel's

  par = models.Parallelism(model_meshes.mesh("fs=2,ep=2,tp=2"))
  mesh_params, mesh_histories = models.fp8.split_state(models.init(cfg, par)[1])
  mesh_histories = jax.tree.map(lambda m, h: jax.device_put(h, m.sharding), mesh_histories, histories)
  with jax.set_mesh(par.mesh):
    _, on_mesh = jax.jit(step_lib.make_gradient(graphdef, par, None, accum=2))(mesh_params, batch, None, mesh_histories)
  model_meshes.assert_close_trees(on_mesh, (grads, amaxes), rtol=1e-5)
