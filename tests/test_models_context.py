"""Context parallelism (models/context.py): the balanced layout, the attention, and every
mesh with cp against one device, in float32."""
import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dion_jax
import models
from models import context
from tests import model_meshes

# 16 tokens split into 2·cp chunks for cp up to 4; two layers keep the compiles short.
CFG = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=16)
BATCH = 8


def _batch(seed=0, cfg=CFG, batch=BATCH):
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


# --- the layout ------------------------------------------------------------------------


def test_balanced_layout_gives_every_rank_chunks_i_and_mirror():
  np.testing.assert_array_equal(context.token_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  for cp in (2, 4):
    order = context.token_order(64, cp).reshape(cp, -1)
    # Causal (query, key) pairs per rank: position p attends p + 1 keys. Equal on every rank.
    C = 64 // (2 * cp)
    np.testing.assert_array_equal((order + 1).sum(1), C * (2 * cp * C + 1))
  with pytest.raises(ValueError, match=r"sequence length 12 does not split into 2·cp = 8 chunks"):
    context.token_order(12, 4)


def test_attention_with_segments_and_fewer_kv_heads_matches_dense():
  """The hooks for packed sequences and grouped-query attention (not used by the GPT yet):
  one device and cp = 2 against the masked softmax written out in NumPy."""
  B, T, N, K, H, cp = 2, 16, 4, 2, 8, 2
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k, v = (rng.normal(size=(B, T, K, H)).astype(np.float32) for _ in range(2))
  segments = np.array([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7], np.int32)
  allowed = np.tril(np.ones((T, T), bool))[None] & (segments[:, :, None] == segments[:, None, :])
  s = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, 2)) / np.sqrt(H)
  s = np.where(allowed[:, None], s, -np.inf)
  a = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bnts,bsnh->btnh", a / a.sum(-1, keepdims=True), np.repeat(v, N // K, 2))

  one = context.attention(q, k, v, implementation="xla", cp=1, segment_ids_BxT=segments)
  np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-6)
  order = context.token_order(T, cp)
  local = jax.shard_map(
      lambda q, k, v, seg: context.attention(q, k, v, implementation="xla", cp=cp, segment_ids_BxT=seg),
      mesh=model_meshes.mesh(f"cp={cp}"), in_specs=P(None, "cp"), out_specs=P(None, "cp"))
  got = local(q[:, order], k[:, order], v[:, order], segments[:, order])
  np.testing.assert_allclose(np.asarray(got)[:, np.argsort(order)], want, rtol=1e-5, atol=1e-6)


# --- every mesh with cp gives one device's loss and gradients --------------------------


@pytest.fixture(scope="module")
def reference():
  return model_meshes.one_device(CFG, _batch())


# cp=2 alone is inside each cp=2 mesh here.
MESHES = [
    ("cp=4", {}),
    ("cp=2,tp=2", {"sequence_parallel": True}),
    ("cp=2,pp=2", {"microbatches": 2}),
    # fs=2,cp=2,tp=2 and rp=2,cp=2: the first step of test_dion_training_with_cp_matches_one_device
]


@pytest.mark.parametrize("spec,options", MESHES, ids=[f"{s}{o}" for s, o in MESHES])
def test_mesh_matches_one_device(reference, spec, options):
  model_meshes.assert_mesh_matches(reference, CFG, _batch(), spec, options)


def test_sequence_that_does_not_split_is_refused():
  par = models.Parallelism(model_meshes.mesh("cp=4"))
  graphdef, params = models.init(CFG, par)
  batch = jax.tree.map(lambda x: x[:, :12], _batch())
  with jax.set_mesh(par.mesh), pytest.raises(ValueError, match="sequence length 12 does not split"):
    models.loss(graphdef, params, batch, par)


def test_without_context_parallelism_any_length_goes():
  """cp=1 keeps the sequence as it is: an odd --seq-len was refused with a cp message."""
  context.check_seq_len(65, 1)
  with pytest.raises(ValueError, match="sequence length 66 does not split into 2·cp = 4 chunks"):
    context.check_seq_len(66, 2)


# --- Dion on meshes with cp: the optimizers see cp as one more fs --------------------


def _init(mesh):
  par = models.Parallelism(mesh)
  graphdef, params = models.init(CFG, par)
  tx = dion_jax.dion(0.02, rank_fraction=0.25, mesh=mesh, partition_specs=models.param_specs(params))
  return par, graphdef, params, tx


def _train(spec, steps=2):
  """Dion steps on ``spec`` (None: one device); per-replica gradients when rp > 1. The
  losses, final parameters and the first step's gradients (Dion's per-replica ones averaged)."""
  mesh = None if spec is None else model_meshes.mesh(spec)
  par, graphdef, params, tx = _init(mesh)
  opt_state = tx.init(params)

  def loss_fn(p, b):
    return models.loss(graphdef, p, b, par)

  if par.size("rp") > 1:
    per_replica = jax.tree.map(lambda label: label == "dion", dion_jax.default_labels(params))
    grad_fn = dion_jax.value_and_grad_per_replica(loss_fn, mesh, per_replica)
  else:
    grad_fn = jax.value_and_grad(loss_fn)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  losses = []
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    for i in range(steps):
      params, opt_state, loss, grads = step(params, opt_state, _batch(seed=i))
      if not losses:
        first_grads = grads
        if par.size("rp") > 1:
          first_grads = jax.tree.map(lambda g, keep: g.mean(0) if keep else g, grads, per_replica)
      losses.append(float(loss))
  return losses, params, first_grads


def _first_device_bytes(tree):
  return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
             if shard.device == jax.devices()[0])


@pytest.fixture(scope="module")
def one_device_training():
  return _train(None)


@pytest.mark.parametrize("spec", ["fs=2,cp=2,tp=2", "rp=2,cp=2"])
def test_dion_training_with_cp_matches_one_device(reference, one_device_training, spec):
  """The first step's loss and gradients are one device's, as in test_mesh_matches_one_device
  (within 1e-5). Losses and Dion's matrices within 1e-5. AdamW's parameters (embedding, LM head,
  norms) within 5e-4: AdamW divides each element's gradient by its own magnitude, so
  where an element's gradient nearly cancels, the rounding of another summation order
  grows to a fraction of a step. Two steps (the second's update reads the first's state);
  measured: 7.8e-5 on fs=2,cp=2,tp=2 and 5.2e-5 on rp=2,cp=2 (after 3 steps, all at one
  embedding element: 5.3e-5 and 2.3e-4; without cp, 3.1e-5 on fs=2,tp=2 and 1.8e-4 on
  rp=4); Dion's matrices 1.9e-7."""
  _, want_loss, want_grads = reference
  want_losses, want_params, _ = one_device_training
  losses, params, grads = _train(spec)
  np.testing.assert_allclose(losses[0], want_loss, rtol=1e-5)
  model_meshes.assert_close_trees(model_meshes.in_layer_order(grads, models.Parallelism()), want_grads, rtol=1e-5)
  assert want_losses[-1] < want_losses[0]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  is_dion = jax.tree.map(lambda label: label == "dion", dion_jax.default_labels(params))
  for keep, rtol in ((True, 1e-5), (False, 5e-4)):
    def pick(tree, keep=keep):
      return [x for x, d in zip(jax.tree.leaves(tree), jax.tree.leaves(is_dion)) if d == keep]
    model_meshes.assert_close_trees(pick(params), pick(want_params), rtol=rtol)


@pytest.mark.parametrize("spec, as_fs", [("fs=2,cp=2,tp=2", "fs=4,tp=2"), ("rp=2,cp=2", "rp=2,fs=2")])
def test_cp_shards_parameters_and_optimizer_state_as_fs_does(spec, as_fs):
  """ZeRO over cp: a device holds the bytes of parameters and Dion's state that it holds
  on the mesh with fs·cp in place of fs, which is less than without the sharding."""
  def device_bytes(mesh_spec):
    _, _, params, tx = _init(model_meshes.mesh(mesh_spec))
    return _first_device_bytes(params), _first_device_bytes(tx.init(params))

  got, want = device_bytes(spec), device_bytes(as_fs)
  assert got == want, (got, want)
  replicated = device_bytes(",".join(a for a in spec.split(",") if not a.startswith("cp=")))
  assert got[0] < 0.55 * replicated[0] and got[1] < 0.55 * replicated[1], (got, replicated)


# --- what the compiled step holds and communicates -------------------------------------


def _compiled(spec, cfg):
  mesh = model_meshes.mesh(spec)
  par = models.Parallelism(mesh)
  graphdef, params = models.init(cfg, par)
  with jax.set_mesh(mesh):
    fn = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par)))
    return mesh, fn.lower(params, _batch(cfg=cfg, batch=4)).compile()


def test_cp_step_holds_no_full_score_block_and_shards_weights_over_cp():
  # T = 48 is no other dimension of the model, so a [..., 48, 48] buffer is a score block.
  cfg = models.preset("tiny", num_layers=2, d_model=32, num_heads=2, seq_len=48)
  B, T, N, H, cp = 4, cfg.seq_len, cfg.num_heads, cfg.head_dim, 2
  full_scores = re.compile(r"\[[0-9,]*\b48,48\]")
  assert full_scores.search(_compiled("cp=1", cfg)[1].as_text())  # the check sees one device's
  mesh, compiled = _compiled(f"cp={cp}", cfg)
  hlo = compiled.as_text()
  assert not full_scores.search(hlo)
  assert re.search(rf"\[{B},{N},{T // cp},{T}\]", hlo)  # this rank's queries x all keys
  stats = {(s.op, s.axes): s for s in dion_jax.collective_stats(compiled, mesh)}
  assert set(stats) == {("all-gather", ("cp",)), ("reduce-scatter", ("cp",)), ("all-reduce", ("cp",))}
  # Activations: all-gathers of K and V, again in the backward pass (only matrix products
  # are saved); reduce-scatters of dK and dV. Weights, stored sharded over cp: a layer's
  # kernels gathered where used, again in the backward pass, their gradients
  # reduce-scattered; the embedding and the LM head gathered once. The scan's body counts
  # once, so a layer's kernels show as one layer's.
  params = models.init(cfg, models.Parallelism(mesh))[1]
  specs = jax.tree.leaves(models.param_specs(params), is_leaf=lambda x: isinstance(x, P))
  layer, whole = [], []  # (full shape, the dimension sharded over cp)
  for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(params), specs):
    dims = [d for d, e in enumerate(spec) if "cp" in dion_jax.parallel.axis_names(e)]
    if dims:
      stacked = path[0].key == "blocks"
      (layer if stacked else whole).append((x.shape[2:] if stacked else x.shape, dims[0] - 2 * stacked))
  assert len(layer) == 6 and len(whole) == 2  # query, key, value, out, up, down; embedding, LM head

  def f32(shape):
    return f"f32[{','.join(map(str, shape))}]"

  def halved(shape, dim):
    return tuple(n // cp if d == dim else n for d, n in enumerate(shape))

  gathers = re.findall(r"= (f32\[[0-9,]*\])\{[^}]*\} all-gather(?:-start)?\(", hlo)
  want = [(B, T, N, H)] * 4 + [shape for shape, _ in 2 * layer + whole]
  assert sorted(gathers) == sorted(map(f32, want)), gathers
  scatters = re.findall(r"= (f32\[[0-9,]*\])\{[^}]*\} reduce-scatter(?:-start)?\(", hlo)
  want = [(B, T // cp, N, H)] * 2 + [halved(*w) for w in layer + whole]
  assert sorted(scatters) == sorted(map(f32, want)), scatters
  # K and V: 4 gathers of B·T·D floats per layer, the scheme's formula.
  weight_bytes = 4 * sum(math.prod(shape) for shape, _ in 2 * layer + whole)
  assert stats[("all-gather", ("cp",))].bytes == 4 * B * T * cfg.d_model * 4 + weight_bytes
  # What is still all-reduced: the loss and the replicated norm scales' gradients, no weight's.
  replicated = (2 * cfg.num_layers + 1) * cfg.d_model
  assert stats[("all-reduce", ("cp",))].bytes <= 4 * (replicated + 2)
