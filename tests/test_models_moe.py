"""Mixture of experts (models/moe.py): the routing against float64 NumPy, every mesh with ep
against one device, Dion and Dion2 on expert stacks, and what the compiled step sends."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dion_jax
import models
from models import gpt, moe
from tests import model_meshes

# 4 experts of width 32, 2 per token; two layers keep the compiles short.
CFG = models.preset("tiny-moe", num_layers=2, d_model=32, num_heads=2, seq_len=16, mlp_dim=32, num_experts=4)
# Half of what an expert would take at an even split: some assignments are dropped.
CAPPED = models.preset("tiny-moe", **{**CFG.__dict__, "moe_capacity_factor": 0.5})
BATCH = 8


def _batch(seed=0, cfg=CFG):
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


# --- the routing against an independent float64 implementation --------------------------


def _np_mlp(x, up, down, gate, kind):
  if kind == "swiglu":
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down
  return np.square(np.maximum(x @ up, 0)) @ down


def _np_moe(x, w, cfg):
  """Token by token, in order: y [B, T, D] and the layer's statistics."""
  B, T, _ = x.shape
  E, k = cfg.num_experts, cfg.moe_top_k
  cap = math.inf if cfg.moe_capacity_factor is None else math.ceil(cfg.moe_capacity_factor * T * k / E)
  logits = x @ w["router"]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  y = np.zeros_like(x)
  balance = z = dropped = 0.0
  load = np.zeros(E)
  for b in range(B):
    taken, routed = np.zeros(E), np.zeros(E)
    for t in range(T):
      top = np.argsort(-probs[b, t], kind="stable")[:k]
      gates = probs[b, t, top] / (probs[b, t, top].sum() if cfg.moe_renormalize else 1.0)
      for g, e in zip(gates, top):
        routed[e] += 1
        if taken[e] < cap:
          taken[e] += 1
          y[b, t] += g * _np_mlp(x[b, t], w["up"][e], w["down"][e], w.get("gate", [None] * E)[e], cfg.mlp)
        else:
          dropped += 1
    balance += E * np.sum(routed / (T * k) * probs[b].mean(0))
    load += routed
    m = logits[b].max(-1)
    z += np.sum(np.square(m + np.log(np.exp(logits[b] - m[:, None]).sum(-1))))
  if cfg.moe_shared_expert:
    y += _np_mlp(x, w["shared_up"], w["shared_down"], w.get("shared_gate"), cfg.mlp)
  return y, moe.RouterStats(balance, z, load, dropped)


ROUTINGS = {
    "dropless": CFG,
    "capacity, swiglu": models.preset("tiny-moe", **{**CAPPED.__dict__, "mlp": "swiglu"}),
    "top-1, raw gates, shared expert": models.preset(
        "tiny-moe", **{**CFG.__dict__, "moe_top_k": 1, "moe_renormalize": False, "moe_shared_expert": True}),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_layer_matches_float64_numpy(name):
  cfg = ROUTINGS[name]
  layer = moe.MoE(cfg, rngs=nnx.Rngs(1))
  x = np.random.default_rng(0).normal(size=(3, cfg.seq_len, cfg.d_model))
  y, stats = layer(jnp.asarray(x, jnp.float32), models.Parallelism())
  w = {"router": layer.router.kernel[...], **{n: getattr(layer.experts, n)[...] for n in ("up", "down", "gate")
                                               if hasattr(layer.experts, n)}}
  if cfg.moe_shared_expert:
    w.update({f"shared_{n}": getattr(layer.shared, n).kernel[...] for n in ("up", "down", "gate")
              if hasattr(layer.shared, n)})
  want_y, want = _np_moe(x, jax.tree.map(lambda a: np.asarray(a, np.float64), w), cfg)
  np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-4, atol=1e-5)
  for got, expected in zip(stats, want):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)
  if cfg.moe_capacity_factor is not None:
    assert want.dropped > 0  # the cap binds, so the test sees drops


def test_loss_adds_the_weighted_router_losses():
  graphdef, params = models.init(CFG)
  batch = _batch()
  loss, aux = jax.jit(lambda p, b: models.loss(graphdef, p, b, aux=True))(params, batch)
  B, T = batch["inputs"].shape
  want = (CFG.moe_aux_loss_coeff * aux.router.balance.sum() + CFG.moe_z_loss_coeff * aux.router.z.sum() / T) / B
  np.testing.assert_allclose(float(aux.router_loss), float(want), rtol=1e-6)
  assert aux.router.load.shape == (1, CFG.num_layers, CFG.num_experts)
  # A near-uniform router at init: each balance term is close to its minimum, 1.
  np.testing.assert_allclose(np.asarray(aux.router.balance) / B, 1.0, atol=0.2)
  dense = models.preset("tiny-moe", **{**CFG.__dict__, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0})
  dense_graphdef = models.abstract(dense)[0]
  without = jax.jit(lambda p, b: models.loss(dense_graphdef, p, b))(params, batch)
  np.testing.assert_allclose(float(without), float(loss - aux.router_loss), rtol=1e-6)


# --- experts on every second layer --------------------------------------------------------

# Two groups of (dense layer, MoE layer).
GROUPED = models.preset("tiny-moe", **{**CFG.__dict__, "num_layers": 4, "moe_every": 2})


def test_every_second_layer_is_a_mixture_of_experts():
  """The grouped stack equals its layers run one by one, in layer order: dense, MoE, dense,
  MoE; the aux reports each layer's logit maxima in that order and the MoE layers' routing."""
  graphdef, params = models.init(GROUPED)
  assert GROUPED.num_params() == sum(x.size for x in jax.tree.leaves(params))
  batch = _batch(cfg=GROUPED)
  loss, aux = jax.jit(lambda p, b: models.loss(graphdef, p, b, aux=True, logit_max=True))(params, batch)

  def layer_by_layer(params, batch):
    model = nnx.merge(graphdef, params)
    dense_def, moe_def = (nnx.graphdef(nnx.eval_shape(lambda e=e: gpt.Block(GROUPED, experts=e, rngs=nnx.Rngs(0))))
                          for e in (False, True))
    groups = models.to_layers(params["blocks"], 1)
    layers = []
    for g in range(GROUPED.num_layers // 2):
      layers.append((dense_def, jax.tree.map(lambda a, g=g: a[g, 0], groups["dense"])))
      layers.append((moe_def, jax.tree.map(lambda a, g=g: a[g], groups["moe"])))
    T = batch["inputs"].shape[1]
    rope = gpt.rotary_tables(GROUPED, jnp.arange(T))
    x, maxima, router = model.embed_tokens(batch["inputs"], models.Parallelism()), [], []
    for layer_def, layer_params in layers:
      x, layer_aux = nnx.merge(layer_def, layer_params)(x, rope, models.Parallelism(), logit_max=True)
      maxima.append(layer_aux["logit_max"])
      if "router" in layer_aux:
        router.append(layer_aux["router"])
    router = jax.tree.map(lambda *a: jnp.stack(a), *router)
    ce = jnp.mean(model.token_losses(x, batch["targets"], models.Parallelism()))
    return ce + moe.router_loss(router, GROUPED, BATCH, T), jnp.stack(maxima), router

  want_loss, want_maxima, want_router = jax.jit(layer_by_layer)(params, batch)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  maxima = models.to_layers(aux.logit_max, 1)  # [groups, moe_every, N]
  np.testing.assert_allclose(np.asarray(maxima).reshape(GROUPED.num_layers, -1), want_maxima, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a[0], b, rtol=1e-6), aux.router, want_router)


# A capacity on cp=2: cp=4's ranks continue the counts of one to three earlier chunks, and
# test_mesh_matches_one_device[fs=2,cp=2,tp=2-capped] takes its loss with the router's.
@pytest.mark.parametrize("cfg, spec", [(CFG, "cp=2"), (CAPPED, "cp=4")], ids=["dropless-cp=2", "capacity-cp=4"])
def test_router_statistics_with_cp_are_one_devices(cfg, spec):
  """With cp a rank routes T/cp tokens of every sequence; the per-sequence sums are taken
  over cp first, so the balance loss (a product of two of them), the z-loss and the load
  equal one device's. Under a capacity a rank's places in each expert's queue continue
  the counts of the sequence's earlier chunks, held by other ranks: the same assignments
  are dropped."""
  batch = _batch()
  graphdef, params = models.init(cfg)
  want = jax.jit(lambda p, b: models.loss(graphdef, p, b, aux=True)[1].router)(params, batch)
  par = models.Parallelism(model_meshes.mesh(spec))
  with jax.set_mesh(par.mesh):
    _, params = models.init(cfg, par)
    got = jax.jit(lambda p, b: models.loss(graphdef, p, b, par, aux=True)[1].router)(params, batch)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5), got, want)
  if cfg.moe_capacity_factor is not None:
    assert float(want.dropped.sum()) > 0


# --- every mesh with ep gives one device's loss and gradients --------------------------


@pytest.fixture(scope="module")
def reference():
  return {cfg: model_meshes.one_device(cfg, _batch(cfg=cfg)) for cfg in (CFG, CAPPED, GROUPED)}


# ep=2 on its own is inside each of these; the pipeline and SP cases run dense layers too.
MESHES = [
    ("fs=2,ep=2", {}, CAPPED),
    ("ep=2,tp=2", {}, CFG),
    ("rp=2,ep=2", {}, CFG),
    ("ep=2,pp=2", {"microbatches": 2}, GROUPED),
    # fs=2,ep=2,tp=2 with sequence parallelism, every second layer: the first step of
    # test_training_on_fs_ep_tp_matches_one_device[dion2]
    ("cp=2,ep=2", {}, GROUPED),
    ("fs=2,cp=2,tp=2", {}, CAPPED),
]
_KIND = {CFG: "", CAPPED: "-capped", GROUPED: "-every-2nd"}


@pytest.mark.parametrize("spec,options,cfg", MESHES, ids=[f"{s}{o}{_KIND[c]}" for s, o, c in MESHES])
def test_mesh_matches_one_device(reference, spec, options, cfg):
  model_meshes.assert_mesh_matches(reference[cfg], cfg, _batch(cfg=cfg), spec, options)


OPTIMIZERS = {
    "dion 1/4": lambda mesh, specs: dion_jax.dion(0.02, rank_fraction=0.25, mesh=mesh, partition_specs=specs),
    # float32 Newton-Schulz: bfloat16's rounding would magnify the meshes' summation order.
    "dion2": lambda mesh, specs: dion_jax.dion2(0.02, selection_scope="global", ortho_dtype=jnp.float32, mesh=mesh,
                                                partition_specs=specs),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_training_on_fs_ep_tp_matches_one_device(reference, name):
  """Dion on expert stacks; Dion2 on a model with dense layers between (5-D dense stacks),
  with sequence parallelism. The first step's loss and gradients are one device's, as in
  test_mesh_matches_one_device (within 1e-5). Two steps: the second's update reads the
  first's optimizer state (measured: parameters within 1.5e-6 (Dion), 8.7e-7 (Dion2))."""
  cfg = GROUPED if name == "dion2" else CFG
  options = {"sequence_parallel": True} if name == "dion2" else {}
  batches = [_batch(seed=i, cfg=cfg) for i in range(2)]  # a step on 8 devices: ~2 s of CPU
  want_losses, want_params, _ = model_meshes.train(cfg, batches, None, {}, OPTIMIZERS[name])
  losses, params, grads = model_meshes.train(cfg, batches, "fs=2,ep=2,tp=2", options, OPTIMIZERS[name])
  _, want_loss, want_grads = reference[cfg]
  np.testing.assert_allclose(losses[0], want_loss, rtol=1e-5)
  model_meshes.assert_close_trees(grads, want_grads, rtol=1e-5)
  assert want_losses[-1] < want_losses[0]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  model_meshes.assert_close_trees(params, want_params, rtol=1e-5)


# --- what each device holds, and what the compiled step communicates --------------------


def test_bytes_per_device_scale_with_ep_fs_tp():
  """Experts split over ep, cp·fs and tp; every other weight over cp·fs·ep and tp."""
  def device_bytes(params):
    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
               if s.device == jax.devices()[0])

  params = models.init(CFG)[1]
  total, experts = device_bytes(params), device_bytes(params["blocks"]["mlp"]["experts"])
  for spec, shards in (("ep=4", 4), ("fs=2,ep=2,tp=2", 8), ("cp=2,ep=2", 4)):  # ep=2 alone: inside the last two
    params = models.init(CFG, models.Parallelism(model_meshes.mesh(spec)))[1]
    assert device_bytes(params["blocks"]["mlp"]["experts"]) == experts // shards, spec
    # Replicated norm scales and the router's tp copies are the only padding: under 5% here.
    assert total / shards <= device_bytes(params) <= total / shards * 1.05, spec
  with pytest.raises(ValueError, match="not divisible"):  # 4 experts do not split 8 ways
    models.init(CFG, models.Parallelism(model_meshes.mesh("ep=8")))


def test_ep_step_sends_tokens_by_all_to_all_and_never_gathers_experts():
  """Capacity factor 1: each direction's all-to-all carries exactly tokens·k rows of d_model."""
  cfg = models.preset("tiny-moe", **{**CFG.__dict__, "moe_capacity_factor": 1.0})
  mesh = model_meshes.mesh("fs=2,ep=2")
  par = models.Parallelism(mesh)
  graphdef, params = models.init(cfg, par)
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par))).lower(
        params, _batch(cfg=cfg)).compile()
  stats = dion_jax.collective_stats(compiled, mesh)
  (to_all,) = [s for s in stats if s.op == "all-to-all"]
  assert to_all.axes == ("ep",)
  # Per layer (one scan body): rows out and back in the forward pass, the same again in the
  # backward pass's recomputation, and the transposes of both; each carries this device's
  # tokens·k rows of d_model (float32). Plus the row counts [ep, E/ep] (int32), twice.
  rows = BATCH // 4 * cfg.seq_len * cfg.moe_top_k * cfg.d_model * 4
  counts = 2 * cfg.num_experts // 2 * 4
  assert (to_all.count, to_all.bytes) == (8, 6 * rows + 2 * counts)
  # Experts are gathered over fs (ZeRO-3), E/ep of them, never across ep: no gathered array
  # holds all E experts. (Dense weights are gathered over fs and ep.)
  gathered = [[int(n) for n in dims.split(",")]
              for dims in re.findall(r"= f32\[([0-9,]*)\]\{[^}]*\} all-gather", compiled.as_text())]
  assert [cfg.num_experts // 2, cfg.d_model, cfg.d_mlp] in gathered
  assert not [g for g in gathered if len(g) == 3 and g[0] == cfg.num_experts]
  assert {s.axes for s in stats if s.op == "all-gather"} == {("fs",), ("fs", "ep")}


def test_router_losses_reach_the_router_gradient():
  """∂(Σ balance)/∂W_r and ∂(Σ z)/∂W_r against their hand-derived float64 forms: with
  l = x W_r, p = softmax(l), f_e each sequence's routed fraction (a constant),
  ∂balance/∂l_t = (E/T) p_t ⊙ (f − p_t·f) and ∂z/∂l_t = 2 lse(l_t) p_t (measured: 7e-7
  relative), so that the losses steer the router rather than only being reported."""
  rng = np.random.default_rng(5)
  B, T, D, E, k = 2, 16, CFG.d_model, CFG.num_experts, CFG.moe_top_k
  x = rng.normal(size=(B, T, D))
  W = rng.normal(size=(D, E)) * 0.3

  def losses(W_f32):
    stats = moe.route(jnp.asarray(x, jnp.float32), W_f32, CFG)[2]
    return stats.balance, stats.z

  got = [np.asarray(g, np.float64) for g in jax.jit(jax.jacrev(losses))(jnp.asarray(W, jnp.float32))]
  logits = x @ W
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, -1)[..., :k]
  f = np.stack([np.bincount(top[b].ravel(), minlength=E) / (T * k) for b in range(B)])  # [B, E]
  d_balance = E / T * p * (f[:, None, :] - np.sum(p * f[:, None, :], -1, keepdims=True))
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  d_z = 2 * lse[..., None] * p
  for name, g, d_logits in [("balance", got[0], d_balance), ("z", got[1], d_z)]:
    want = np.einsum("btd,bte->de", x, d_logits)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)


def test_balance_loss_spreads_a_skewed_router():
  """Gradient descent on the balance loss alone moves a router that sends most tokens to
  expert 0 (max/mean load 1.94 of at most 2 with top-2) towards an even load (measured:
  1.17 after 50 steps)."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(2, 64, CFG.d_model)) + 0.5, jnp.float32)
  W = rng.normal(size=(CFG.d_model, CFG.num_experts)) * 0.1
  W[:, 0] += 4.0 / CFG.d_model  # every token's mean +0.5 raises expert 0's logit by ~2
  W = jnp.asarray(W, jnp.float32)
  stats = lambda W: moe.route(x, W, CFG)[2]  # noqa: E731
  skew = lambda W: float(jnp.max(stats(W).load) / jnp.mean(stats(W).load))  # noqa: E731
  assert skew(W) > 1.8
  step = jax.jit(lambda W: W - 0.5 * jax.grad(lambda W: stats(W).balance)(W))
  for _ in range(50):
    W = step(W)
  assert skew(W) < 1.4
