"""QK-clip: the forward pass's attention-logit maxima against float64 NumPy and on every
mesh against one device; after a clip, each clipped head's largest logit is τ and nothing
else moves."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dion_jax
import models
from models import qk_clip
from tests.test_models_gpt import PUBLISHED_NORM_EPS, PUBLISHED_ROPE_BASE

BATCH = 4


def _cfg(num_kv_heads, num_layers=1):
  return models.preset("tiny", num_layers=num_layers, d_model=64, num_heads=4, num_kv_heads=num_kv_heads,
                       seq_len=16, qk_norm="none", mlp="swiglu")


def _batch(cfg, seed=0):
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def _logits(graphdef, params, batch, par=models.Parallelism()):
  """The maxima of ``models.loss``, in layer order [L, N]."""
  fn = jax.jit(lambda p, b: models.loss(graphdef, p, b, par, aux=True, logit_max=True)[1].logit_max)
  if par.mesh is None:
    return models.to_layers(fn(params, batch), 1)
  with jax.set_mesh(par.mesh):
    return models.to_layers(fn(params, batch), par.pp, par.virtual_stages)


def _np_first_layer_logit_max(params, cfg, inputs):
  """Layer 0's largest causal logit per query head, float64, from the definition."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64)[0, 0], params["blocks"])
  B, T = inputs.shape
  N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
  x = np.asarray(params["embed"]["embedding"], np.float64)[inputs]
  h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + PUBLISHED_NORM_EPS) * p["attn_norm"]["scale"]
  half = H // 2
  angle = np.arange(T)[:, None] / PUBLISHED_ROPE_BASE ** (np.arange(half) / half)
  cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

  def rotary(z):
    z1, z2 = z[..., :half], z[..., half:]
    return np.concatenate([z1 * cos + z2 * sin, z2 * cos - z1 * sin], -1)

  q = rotary((h @ p["attn"]["query"]["kernel"]).reshape(B, T, N, H))
  k = rotary((h @ p["attn"]["key"]["kernel"]).reshape(B, T, K, H))
  causal = np.tril(np.ones((T, T), bool))
  out = []
  for n in range(N):
    s = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // (N // K)]) / np.sqrt(H)
    out.append(np.where(causal, s, -np.inf).max())
  return np.array(out)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_logit_maxima_match_float64(num_kv_heads):
  cfg = _cfg(num_kv_heads)
  graphdef, params = models.init(cfg)
  batch = _batch(cfg)
  got = _logits(graphdef, params, batch)
  want = _np_first_layer_logit_max(params, cfg, np.asarray(batch["inputs"]))
  np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_clipped_heads_reach_tau_and_nothing_else_moves(num_kv_heads):
  cfg = _cfg(num_kv_heads)
  graphdef, params = models.init(cfg)
  params = jax.tree.map(lambda x: x * 3.0 if x.ndim == 4 else x, params)  # larger logits
  batch = _batch(cfg)
  before = np.asarray(_logits(graphdef, params, batch)[0])
  tau = float(np.median(before))
  clipped_params, clipped = qk_clip.qk_clip(params, models.to_stages(jnp.asarray(before)[None], 1), tau, cfg)
  after = np.asarray(_logits(graphdef, clipped_params, batch)[0])
  over = before > tau
  assert int(clipped) == over.sum() == 2
  np.testing.assert_allclose(after[over], tau, rtol=1e-5)
  np.testing.assert_allclose(after[~over], before[~over], rtol=1e-6)
  H = cfg.head_dim
  heads = lambda tree, name: np.asarray(tree["blocks"]["attn"][name]["kernel"]).reshape(-1, H)  # noqa: E731
  q_old, q_new = (heads(t, "query").reshape(cfg.d_model, cfg.num_heads, H) for t in (params, clipped_params))
  np.testing.assert_array_equal(q_new[:, ~over], q_old[:, ~over])
  if num_kv_heads < cfg.num_heads:  # GQA: the shared key heads keep their kernels.
    np.testing.assert_array_equal(heads(clipped_params, "key"), heads(params, "key"))
  others = lambda tree: {k: v for k, v in tree["blocks"]["attn"].items() if k not in ("query", "key")}  # noqa: E731
  jax.tree.map(np.testing.assert_array_equal, others(clipped_params), others(params))


def test_clip_reaches_the_dense_and_the_moe_layers_of_a_group():
  """Experts on every second layer: the maxima [1, groups, 2, N] clip the dense layer's heads
  through the first entry of each group and the mixture's through the last."""
  cfg = models.preset("tiny", **{**_cfg(4, num_layers=2).__dict__, "num_experts": 2, "moe_every": 2})
  graphdef, params = models.init(cfg)
  params = jax.tree.map(lambda x: x * 3.0 if x.ndim == 4 else x, params)
  batch = _batch(cfg)
  before = np.asarray(_logits(graphdef, params, batch)[0])  # [2 layers, N]
  for layer in (0, 1):  # only this layer's heads over tau: the other layer's maxima lowered
    tau = float(np.median(before[layer]))
    maxima = before.copy()
    maxima[1 - layer] = tau - 1
    clipped_params, clipped = qk_clip.qk_clip(params, jnp.asarray(maxima)[None, None], tau, cfg)
    after = np.asarray(_logits(graphdef, clipped_params, batch)[0])
    over = before[layer] > tau
    assert int(clipped) == over.sum() == 2
    np.testing.assert_allclose(after[layer][over], tau, rtol=1e-5)
    np.testing.assert_allclose(after[layer][~over], before[layer][~over], rtol=1e-6)
    if layer == 1:  # the dense layer before it is untouched
      np.testing.assert_array_equal(after[0], before[0])


@pytest.mark.parametrize("mesh_spec", ["fs=2,tp=2", "tp=2,pp=2", "rp=2,fs=2", "cp=2,tp=2", "cp=2,pp=2"])
def test_logit_maxima_on_a_mesh_equal_one_device(mesh_spec):
  cfg = _cfg(2, num_layers=4)
  batch = _batch(cfg, seed=1)
  graphdef, params = models.init(cfg)
  want = _logits(graphdef, params, batch)
  mesh = dion_jax.make_mesh(mesh_spec, jax.devices()[: int(np.prod(list(dion_jax.parse_mesh_spec(mesh_spec).values())))])
  par = models.Parallelism(mesh, sequence_parallel="tp" in mesh_spec, microbatches=2 if "pp" in mesh_spec else 1)
  graphdef, params_mesh = models.init(cfg, par)
  np.testing.assert_allclose(np.asarray(_logits(graphdef, params_mesh, batch, par)), np.asarray(want), rtol=1e-5)


def test_models_with_qk_norm_are_refused():
  with pytest.raises(ValueError, match="qk_norm='none'"):
    qk_clip.check(models.preset("tiny"), 50.0)
  with pytest.raises(ValueError, match="positive"):
    qk_clip.check(_cfg(2), 0.0)
