"""The run's learning-rate schedule against Megatron's formulas, its weight-decay groups,
gradient clipping against an independent norm, and Dion's flags in the step it builds."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from train.run import optim, setup
from train.run.config import Config


def megatron_lr(step, lr, min_lr, warmup, decay, style, wsd_decay):
  """Megatron-LM's OptimizerParamScheduler.get_lr at ``num_steps = step`` (init_lr 0)."""
  if warmup > 0 and step <= warmup:
    return lr * step / warmup
  if style == "constant":
    return lr
  if step > decay:
    return min_lr
  ratio = (step - warmup) / (decay - warmup)
  if style == "linear":
    coeff = 1.0 - ratio
  elif style == "cosine":
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
  else:  # wsd with a linear anneal over its last wsd_decay steps
    anneal_start = decay - wsd_decay
    coeff = 1.0 if step <= anneal_start else 1.0 - (step - anneal_start) / wsd_decay
  return min_lr + coeff * (lr - min_lr)


def expected_lr(count, lr, min_lr, warmup, decay, style, wsd_decay):
  """The run's lr at optimizer step ``count`` (0-based): Megatron's decay, and its warmup one
  step ahead so that the first step already moves (lr / warmup, not 0)."""
  step = count + 1 if count < warmup else count
  return megatron_lr(step, lr, min_lr, warmup, decay, style, wsd_decay)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
@pytest.mark.parametrize("warmup,min_lr", [(5, 1e-3), (0, 0.0)])
def test_schedule_is_megatrons(style, warmup, min_lr):
  cfg = Config(optimizer="adamw", lr=0.02, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_style=style,
               steps=40, lr_decay_steps=30, lr_wsd_decay_steps=8)
  schedule = optim.schedule(cfg)
  for count in [0, 1, 3, 4, 5, 6, 10, 17, 21, 22, 25, 28, 29, 30, 35, 39]:
    want = expected_lr(count, 0.02, min_lr, warmup, 30, style, 8)
    np.testing.assert_allclose(float(schedule(count)), want, rtol=1e-6, atol=1e-9, err_msg=f"count {count}")


def test_schedule_defaults_warmup_and_wsd_decay():
  """Warmup defaults to 5% of the decay steps, wsd's anneal to a fifth of them."""
  cfg = Config(optimizer="adamw", lr=0.01, min_lr=1e-4, lr_decay_style="wsd", steps=200)
  schedule = optim.schedule(cfg)
  for count in [0, 4, 9, 10, 100, 160, 161, 180, 199]:
    want = expected_lr(count, 0.01, 1e-4, 10, 200, "wsd", 40)
    np.testing.assert_allclose(float(schedule(count)), want, rtol=1e-6, atol=1e-9, err_msg=f"count {count}")


def _is_scalar_group(path) -> bool:
  """Embeddings, LM head and norms: by name, not by the optimizer's own labels."""
  name = jax.tree_util.keystr(path)
  return any(part in name for part in ("embed", "lm_head", "norm"))


@pytest.mark.parametrize("optimizer", ["adamw", "dion"])
def test_weight_decay_groups_after_one_step(optimizer):
  """With a zero gradient the step is the decoupled decay alone: matrices shrink by
  lr·--weight-decay, embeddings, LM head and norms by lr·--scalar-weight-decay."""
  lr, wd, scalar_wd = 0.01, 0.1, 0.3
  cfg = Config(optimizer=optimizer, lr=lr, weight_decay=wd, scalar_weight_decay=scalar_wd,
               lr_warmup_steps=0, lr_decay_style="constant", steps=10, mesh="fs=1")
  model_cfg = models.preset("tiny", num_layers=1, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
  mesh = setup.make_mesh("fs=1")
  with jax.set_mesh(mesh):
    _, params = models.init(model_cfg, models.Parallelism(mesh), 0)
    tx = optim.optimizer(cfg, params, mesh, models.param_specs(params))
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  new = optax.apply_updates(params, updates)
  groups = {True: 0, False: 0}

  def check(path, before, after):
    decay = scalar_wd if _is_scalar_group(path) else wd
    groups[_is_scalar_group(path)] += 1
    np.testing.assert_allclose(np.asarray(after), np.asarray(before) * (1 - lr * decay), rtol=1e-6,
                               atol=1e-9, err_msg=jax.tree_util.keystr(path))

  jax.tree_util.tree_map_with_path(check, params, new)
  assert groups[True] >= 4 and groups[False] >= 4  # embedding, head, three norms; the block's matrices


def test_adamw_is_the_published_recipe():
  """--optimizer adamw against AdamW written out in float64, with microsoft/dion's betas
  (0.9, 0.95) and epsilon 1e-8: matrices decay by --weight-decay, vectors by
  --scalar-weight-decay (measured: 1.3e-7 after three steps, float32 rounding of values ~1)."""
  lr, wd, scalar_wd, b1, b2, eps = 0.01, 0.1, 0.02, 0.9, 0.95, 1e-8
  cfg = Config(optimizer="adamw", lr=lr, weight_decay=wd, scalar_weight_decay=scalar_wd, lr_warmup_steps=0,
               lr_decay_style="constant", steps=10)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,))}
  grads = [{k: rng.normal(size=v.shape) for k, v in params.items()} for _ in range(3)]
  tx = optim.optimizer(cfg, jax.tree.map(jnp.asarray, params), None, None)
  update = jax.jit(tx.update)
  got = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  state = tx.init(got)
  for g in grads:
    updates, state = update(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), g), state, got)
    got = optax.apply_updates(got, updates)
  for name, decay in [("w", wd), ("b", scalar_wd)]:
    p, m, v = params[name], 0.0, 0.0
    for t, g in enumerate(grads, 1):
      m, v = b1 * m + (1 - b1) * g[name], b2 * v + (1 - b2) * g[name] ** 2
      p = p - lr * ((m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decay * p)
    np.testing.assert_allclose(np.asarray(got[name]), p, rtol=1e-6, atol=1e-7, err_msg=name)


def test_dion_rank_by_width_unless_given():
  """Without --dion-rank-fraction Dion takes the rank of its width (tiny's 128: full rank;
  small's 768: half, the measured choice of README "Training"), read off the widest Dion matrix's shorter side; a flag
  wins. The planner defaults alike."""
  from train.run.plan import planner as plan

  for preset, want in (("tiny", 1.0), ("small", 0.5)):
    _, params = models.abstract(models.preset(preset))
    assert optim.rank_fraction(Config(), params) == want
    assert optim.rank_fraction(Config(dion_rank_fraction=0.25), params) == 0.25
    assert plan.plan(preset, "fs=8", compare=False)["rank_fraction"] == want
  assert optim.default_rank_fraction(127) == 1.0


@pytest.mark.parametrize("flags,marker", [
    ({"dion_power_precision": "bfloat16"}, "xbf16>"),
    ({"dion_qr_precision": "tensorfloat32x3"}, "num_primitive_operations = 3")])
def test_dion_precision_flags_reach_the_step(monkeypatch, flags, marker):
  """--dion-power-precision and --dion-qr-precision change the products of the optimizer the
  trainer builds, traced as on a GPU (where the defaults carry neither marker)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # read when traced
  model_cfg = models.preset("tiny", num_layers=1, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
  _, params = models.abstract(model_cfg)

  def dots(**flags):
    cfg = Config(optimizer="dion", dion_qr_method="shifted_cqr", steps=10, **flags)
    tx = optim.optimizer(cfg, params, None, None)
    state = jax.eval_shape(tx.init, params)
    lowered = jax.jit(tx.update).trace(params, state, params).lower(lowering_platforms=("cuda",))
    return [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]

  assert any(marker in line for line in dots(**flags))
  assert not any(marker in line for line in dots())
