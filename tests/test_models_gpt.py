"""The GPT against a float64 NumPy reference, and every mesh against one device."""
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dion_jax
import models
from dion_jax.accounting import hlo as comms
from models import gpt
from tests import model_meshes, xla_env

CFG = models.preset("tiny", num_layers=4, d_model=64, num_heads=4, seq_len=16)
BATCH = 8


def _batch(seed=0, cfg=CFG):
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


# --- an independent float64 implementation of the forward pass ------------------------

# The defaults pinned to the published model (microsoft/dion's GPT, from modded-nanogpt),
# not read from the config under test: rotary base 10000, and F.rms_norm's default
# epsilon, float32's machine epsilon.
PUBLISHED_ROPE_BASE = 10000.0
PUBLISHED_NORM_EPS = float(np.finfo(np.float32).eps)


def _np_rms(x, scale=None, eps=PUBLISHED_NORM_EPS):
  y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  return y if scale is None else y * scale


def np_token_losses(params, cfg, inputs, targets):
  """float64 next-token cross-entropy [B, T] of the tiny preset's architecture."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  blocks = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), p["blocks"])
  B, T = inputs.shape
  N, H = cfg.num_heads, cfg.head_dim
  x = p["embed"]["embedding"][inputs]
  half = H // 2
  inv_freq = 1.0 / PUBLISHED_ROPE_BASE ** (np.arange(half) / half)
  ang = np.arange(T)[:, None] * inv_freq[None]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

  def rotary(z):
    z1, z2 = z[..., :half], z[..., half:]
    return np.concatenate([z1 * cos + z2 * sin, z2 * cos - z1 * sin], -1)

  causal = np.tril(np.ones((T, T), bool))
  for l in range(cfg.num_layers):
    w = jax.tree.map(lambda a: a[l], blocks)
    h = _np_rms(x, w["attn_norm"]["scale"])
    q, k, v = (h @ w["attn"][n]["kernel"] for n in ("query", "key", "value"))
    q, k, v = (z.reshape(B, T, N, H) for z in (q, k, v))
    q, k = _np_rms(rotary(q)), _np_rms(rotary(k))
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    s = np.where(causal, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", a, v).reshape(B, T, N * H)
    x = x + o @ w["attn"]["out"]["kernel"]
    h = _np_rms(x, w["mlp_norm"]["scale"])
    x = x + np.square(np.maximum(h @ w["mlp"]["up"]["kernel"], 0)) @ w["mlp"]["down"]["kernel"]
  logits = _np_rms(x, p["final_norm"]["scale"]) @ p["lm_head"]["kernel"]
  m = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
  return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def _np_loss(params, cfg, inputs, targets):
  return np.mean(np_token_losses(params, cfg, inputs, targets))


@pytest.mark.parametrize("embedding_rms", [None, 3e-4])
def test_loss_matches_float64_numpy(embedding_rms):
  """At the initial scale, and with embeddings whose mean square (9e-8) is near the norm
  epsilon (1.2e-7), so that a wrong epsilon moves the loss (measured: 10x moves it by 4.8e-3
  relative, 0.1x by 1.9e-3; the float32 model reaches 2.2e-7)."""
  graphdef, params = models.init(CFG, seed=1)
  batch = _batch()
  # Non-trivial norm scales, so a missing scale would show.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * 1.5 if "scale" in jax.tree_util.keystr(path) else x, params)
  if embedding_rms is not None:
    table = params["embed"]["embedding"]
    params["embed"]["embedding"] = table * (embedding_rms / jnp.sqrt(jnp.mean(table * table)))
  got = float(models.loss(graphdef, params, batch))
  want = _np_loss(params, CFG, np.asarray(batch["inputs"]), np.asarray(batch["targets"]))
  np.testing.assert_allclose(got, want, rtol=2e-6)


def test_initial_loss_is_near_uniform():
  graphdef, params = models.init(CFG)
  loss = float(models.loss(graphdef, params, _batch()))
  assert abs(loss - np.log(CFG.padded_vocab)) < 1.0


# --- every mesh gives one device's loss and gradients ----------------------------------


@pytest.fixture(scope="module")
def reference():
  return model_meshes.one_device(CFG, _batch())


# tp=2 alone, with and without sequence parallelism, is inside fs=2,tp=2 and rp=2,fs=2,tp=2's.
MESHES = [
    ("fs=2,tp=2", {}),
    ("pp=2", {"microbatches": 4}),
    ("pp=2", {"microbatches": 4, "virtual_stages": 2}),
    # fs=2,tp=2,pp=2 with 2 micro-batches: test_dion_training_on_fs_tp_pp_matches_one_device's first step
    ("rp=2,fs=2,tp=2", {"sequence_parallel": True}),
    ("rp=2,tp=2,pp=2", {"microbatches": 2, "virtual_stages": 2}),
]


@pytest.mark.parametrize("spec,options", MESHES, ids=[f"{s}{o}" for s, o in MESHES])
def test_mesh_matches_one_device(reference, spec, options):
  model_meshes.assert_mesh_matches(reference, CFG, _batch(), spec, options)


# A table no larger than each rank's tokens: vocab 16 (padded to 128) over tp=2 is 64 rows,
# against 64 tokens on fs=2,cp=2,tp=2 (4 sequences of 32 over cp=2) and 128 on fs=2,tp=2,pp=2.
# There XLA from jaxlib 0.11 aborted the process partitioning jnp.take of the table inside the
# shard_map over cp or pp (models.layers._rows); CFG's, 192 rows against 32 tokens, compiled.
LOOKUP_CFG = models.preset("tiny", num_layers=2, d_model=32, num_heads=2, vocab_size=16, seq_len=32)


def test_vocab_parallel_lookup_inside_a_shard_map_matches_one_device():
  """On fs=2,cp=2,tp=2 and on fs=2,tp=2,pp=2 (2 micro-batches), compiled in one subprocess:
  where XLA fails to partition a program it aborts the process, which fails this test rather
  than ending pytest's worker (or, with -n 0, the run)."""
  check = ("from tests import model_meshes, test_models_gpt as t\n"
           "cfg, batch = t.LOOKUP_CFG, t._batch(cfg=t.LOOKUP_CFG)\n"
           "reference = model_meshes.one_device(cfg, batch)\n"
           "for spec, options in [('fs=2,cp=2,tp=2', {}), ('fs=2,tp=2,pp=2', {'microbatches': 2})]:\n"
           "  model_meshes.assert_mesh_matches(reference, cfg, batch, spec, options)\n"
           "  print(spec, 'matches', flush=True)")
  env = {**xla_env.subprocess_env(), "JAX_PLATFORMS": "cpu"}
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  proc = subprocess.run([sys.executable, "-c", check], cwd=pathlib.Path(__file__).parents[1], env=env,
                        capture_output=True, text=True, timeout=600)
  # XLA's own message and the Python traceback, without the native stack's frames.
  message = "\n".join(line for line in proc.stderr.splitlines() if not line.lstrip().startswith("@"))
  if proc.returncode:
    pytest.fail(f"exit status {proc.returncode} after {proc.stdout.split()[::2]}:\n{message[-3000:]}")
  assert proc.stdout.split() == ["fs=2,cp=2,tp=2", "matches", "fs=2,tp=2,pp=2", "matches"], proc.stdout


def test_remat_and_bfloat16():
  graphdef, params = models.init(CFG)
  batch = _batch()
  grad = jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch)))
  loss, grads = grad(params)
  remat_graphdef, _ = models.init(models.preset("tiny", **{**CFG.__dict__, "remat": True}))
  loss_r, grads_r = jax.jit(jax.value_and_grad(lambda p: models.loss(remat_graphdef, p, batch)))(params)
  np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
  model_meshes.assert_close_trees(grads_r, grads, rtol=1e-5)
  bf16_graphdef, _ = models.init(models.preset("tiny", **{**CFG.__dict__, "dtype": "bfloat16"}))
  np.testing.assert_allclose(float(models.loss(bf16_graphdef, params, batch)), float(loss), rtol=2e-2)


@pytest.mark.parametrize("spec,options", [("pp=1", {}), ("pp=2", {"microbatches": 4})])
def test_loss_scale_reaches_the_float16_backward_pass(reference, spec, options):
  """``models.loss(..., scale=s)`` is s times the loss, and the float16 backward pass runs on
  the scaled cotangent, inside the pipeline's own gradient too: 2^8 gives 2^8 times float32's
  gradient within float16's rounding (measured: at most 1.9e-3), and 2^40 overflows float16
  while the float32 loss stays finite."""
  _, want_loss, want_grads = reference
  par = models.Parallelism(model_meshes.mesh(spec), **options)
  graphdef, params = models.init(models.preset("tiny", **{**CFG.__dict__, "dtype": "float16"}), par)
  batch = _batch()
  grad = jax.jit(jax.value_and_grad(lambda p, scale: models.loss(graphdef, p, batch, par, scale)))
  with jax.set_mesh(par.mesh):
    loss, grads = grad(params, jnp.float32(2**8))
    np.testing.assert_allclose(float(loss) / 2**8, want_loss, rtol=1e-3)
    model_meshes.assert_close_trees(jax.tree.map(lambda g: g / 2**8, model_meshes.in_layer_order(grads, par)), want_grads, rtol=1e-2)
    loss, grads = grad(params, jnp.float32(2**40))
  assert np.isfinite(float(loss)) and not all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


# --- training with Dion on a mesh ---------------------------------------------------


def _train(spec, options):
  return model_meshes.train(CFG, [_batch(seed=i) for i in range(2)], spec, options,
                            lambda mesh, specs: dion_jax.dion(0.02, rank_fraction=0.25, mesh=mesh,
                                                              partition_specs=specs))


def test_dion_training_on_fs_tp_pp_matches_one_device(reference):
  """Two Dion steps on fs=2,tp=2,pp=2 (2 micro-batches) against one device's (the second's
  update reads the first's optimizer state); the first step's loss and gradients are one
  device's as in test_mesh_matches_one_device (within 1e-5)."""
  _, want_loss, want_grads = reference
  want_losses, want_params, _ = _train(None, {})
  losses, params, grads = _train("fs=2,tp=2,pp=2", {"microbatches": 2})
  np.testing.assert_allclose(losses[0], want_loss, rtol=1e-5)
  model_meshes.assert_close_trees(grads, want_grads, rtol=1e-5)
  assert want_losses[-1] < want_losses[0]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  # Dion's steps carry float32 rounding: 9.3e-6 in lm_head after two (2.8e-5 after three) with
  # XLA's unoptimized CPU code.
  model_meshes.assert_close_trees(params, want_params, rtol=5e-5)


# --- what each device holds, and what the compiled step communicates --------------------


def _device_bytes(params):
  return sum(shard.data.nbytes for x in jax.tree.leaves(params) for shard in x.addressable_shards
             if shard.device == jax.devices()[0])


def test_parameter_bytes_per_device_scale_with_the_mesh():
  cfg = models.preset("tiny", num_layers=4, d_model=64, num_heads=4, seq_len=16, vocab_size=512)
  total = _device_bytes(models.init(cfg)[1])
  # Each mesh's bytes are the total over the product of its axes, so each axis's factor shows:
  # fs, tp and pp in the first, fs's size in the second, cp in the third.
  for spec in ("fs=2,tp=2,pp=2", "fs=4,tp=2", "fs=2,cp=2,tp=2"):
    sizes = dion_jax.parse_mesh_spec(spec)
    shards = sizes["fs"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
    par = models.Parallelism(model_meshes.mesh(spec), microbatches=sizes["pp"])
    per_device = _device_bytes(models.init(cfg, par)[1])
    # Replicated vectors (norm scales) are the only padding: under 2% here.
    assert total / shards <= per_device <= total / shards * 1.02, spec


def _compiled_step(spec, cfg=CFG, **options):
  mesh = model_meshes.mesh(spec)
  par = models.Parallelism(mesh, **options)
  graphdef, params = models.init(cfg, par)
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par))).lower(
        params, _batch(cfg=cfg)).compile()
  return mesh, compiled


def test_full_vocabulary_logits_never_on_one_device():
  cfg = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=16, vocab_size=300)
  assert cfg.padded_vocab == 384
  _, compiled = _compiled_step("tp=2", cfg)
  hlo = compiled.as_text()
  # Only vocab shards exist on a device: no array has a dimension of the full vocabulary.
  assert re.search(r"\[[0-9,]*\b192\b[0-9,]*\]", hlo)
  assert not re.search(r"\[[0-9,]*\b384\b[0-9,]*\]", hlo)


def test_fs_tp_step_gathers_one_layer_at_a_time():
  mesh, compiled = _compiled_step("fs=2,tp=2", sequence_parallel=True)
  stats = dion_jax.collective_stats(compiled, mesh)
  ops = {(s.op, s.axes) for s in stats}
  # Expected: weight gathers over fs, activation gathers/reductions over tp (vocab-parallel
  # loss, SP), weight-gradient reductions over fs; nothing over rp or pp, no all-to-all.
  assert ("all-gather", ("fs",)) in ops and ("all-gather", ("tp",)) in ops
  assert all(not set(s.axes) & {"rp", "pp"} and s.op != "all-to-all" for s in stats), stats
  D, F, V = CFG.d_model, CFG.d_mlp, CFG.padded_vocab
  largest_layer_kernel = D * F // 2 * 4  # MLP kernels, tp-sharded, gathered over fs
  table = V // 2 * D * 4  # embedding / LM head, tp-sharded, gathered over fs
  hlo = compiled.as_text()
  for shape in re.findall(r"= (f32\[[0-9,]*\])\{[^}]*\} all-gather", hlo):
    assert comms.shape_bytes(shape) <= max(largest_layer_kernel, table), shape
  # ZeRO-3: the backward pass gathers each of a layer's six kernels again rather than
  # keeping every layer's gathered kernels from the forward pass.
  backward_gathers = [line for line in hlo.splitlines()
                      if re.search(r" all-gather(-start)?\(", line) and "transpose(jvp" in line]
  assert len(backward_gathers) >= 6


def test_bfloat16_layers_keep_a_float32_residual_stream():
  """With --dtype bfloat16 the products run in bfloat16, but a layer adds its outputs to a
  float32 residual: the input's low mantissa bits survive (measured: no element of the
  output is a bfloat16 value; rounding the stream to bfloat16 would make all of them one)."""
  cfg = models.preset("tiny", **{**CFG.__dict__, "dtype": "bfloat16"})
  block = gpt.Block(cfg, experts=False, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, cfg.seq_len, cfg.d_model)), jnp.float32)
  out, _ = jax.jit(lambda x: block(x, gpt.rotary_tables(cfg, jnp.arange(cfg.seq_len)), models.Parallelism()))(x)
  assert out.dtype == jnp.float32
  out = np.asarray(out)
  assert np.mean(out != out.astype(jnp.bfloat16).astype(np.float32)) > 0.9
