"""Shared by the model's mesh tests: a mesh of the first devices, trees in layer order,
and one mesh's loss and gradients, to compare with one device's."""
import contextlib

import jax
import numpy as np
import optax

import dion_jax
import models


def mesh(spec):
  """The mesh ``spec`` on as many of the 8 devices as it needs."""
  sizes = dion_jax.parse_mesh_spec(spec)
  return dion_jax.make_mesh(spec, jax.devices()[: int(np.prod(list(sizes.values())))])


def in_layer_order(tree, par):
  return {**tree, "blocks": models.to_layers(tree["blocks"], par.pp, par.virtual_stages)}


def assert_close_trees(got, want, rtol):
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    err = np.max(np.abs(g - w)) / np.max(np.abs(w))
    assert err < rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def one_device(cfg, batch):
  """``(graphdef, loss, grads in layer order)`` of ``cfg``'s model at seed 0 on one device."""
  graphdef, params = models.init(cfg)
  loss, grads = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b)))(params, batch)
  return graphdef, float(loss), in_layer_order(grads, models.Parallelism())


def assert_mesh_matches(reference, cfg, batch, spec, options, rtol=1e-5):
  """The loss and gradients of ``cfg``'s model on the mesh ``spec`` (``options`` of
  :class:`models.Parallelism`) equal ``reference`` (:func:`one_device`'s); with rp > 1,
  Dion's per-replica gradients, averaged."""
  graphdef, want_loss, want_grads = reference
  par = models.Parallelism(mesh(spec), **options)
  _, params = models.init(cfg, par)

  def loss_fn(p, b):
    return models.loss(graphdef, p, b, par)

  per_replica = jax.tree.map(lambda label: label == "dion", dion_jax.default_labels(params))
  with jax.set_mesh(par.mesh):
    if par.size("rp") > 1:
      loss, grads = jax.jit(dion_jax.value_and_grad_per_replica(loss_fn, par.mesh, per_replica))(params, batch)
      grads = jax.tree.map(lambda g, keep: g.mean(0) if keep else g, grads, per_replica)
    else:
      loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
  np.testing.assert_allclose(float(loss), want_loss, rtol=rtol)
  assert_close_trees(in_layer_order(grads, par), want_grads, rtol=rtol)


def train(cfg, batches, spec, options, optimizer):
  """Losses, final parameters and the first step's gradients (both in layer order) of a step
  per batch of ``batches`` on the mesh ``spec`` (None: one device), ``optimizer(mesh,
  partition_specs)`` an optax transformation. The first step's loss and gradients are
  :func:`one_device`'s on the mesh (the same program computes them), so a test that trains
  on a mesh checks them against one device's as :func:`assert_mesh_matches` does.

  One device gets the model's PartitionSpecs too: they name each matrix's tp dimension,
  which the Dion family orthonormalizes, so that it runs the mesh's algorithm.
  """
  mesh_ = None if spec is None else mesh(spec)
  par = models.Parallelism(mesh_, **options)
  graphdef, params = models.init(cfg, par)
  tx = optimizer(mesh_, models.param_specs(params))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: models.loss(graphdef, p, batch, par))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  losses = []
  with jax.set_mesh(mesh_) if mesh_ is not None else contextlib.nullcontext():
    for batch in batches:
      params, opt_state, loss, grads = step(params, opt_state, batch)
      if not losses:
        first_grads = in_layer_order(grads, par)
      losses.append(float(loss))
  return losses, in_layer_order(params, par), first_grads
