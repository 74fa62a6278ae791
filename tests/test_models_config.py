"""Presets, overrides and the parameter and flop counts of GPTConfig."""
import math

import jax
import pytest
from flax import nnx

import dion_jax
import models


def _count(cfg):
  shapes = jax.eval_shape(lambda: nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0))))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_num_params_counts_the_model(name):
  cfg = models.preset(name)
  assert cfg.num_params() == _count(cfg)


def test_small_is_gpt2_small():
  cfg = models.preset("small")
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.seq_len, cfg.padded_vocab) == (12, 768, 6, 1024, 50304)
  # GPT-2's "124M" counts one 50k x 768 table (tied); untied, the LM head is that table.
  assert cfg.num_params(embeddings=False) == pytest.approx(124e6, rel=0.01)


def test_overrides_and_bad_values():
  assert models.preset("tiny", num_layers=2, dtype="bfloat16").num_layers == 2
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    models.preset("huge")
  with pytest.raises(ValueError, match=r"unknown GPTConfig fields \['layers'\]"):
    models.preset("tiny", layers=2)
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    models.preset("tiny", num_heads=3)
  assert models.preset("tiny", dtype="float16", attention="cudnn").dtype == "float16"
  with pytest.raises(ValueError, match="dtype must be one of"):
    models.preset("tiny", dtype="float64")
  with pytest.raises(ValueError, match="cuDNN attention needs dtype='bfloat16' or 'float16'"):
    models.preset("tiny", attention="cudnn")
  with pytest.raises(ValueError, match="num_layers must be a positive integer"):
    models.preset("tiny", num_layers=0)
  with pytest.raises(ValueError, match="loss_chunk must be 0 .unchunked. or a positive number of tokens"):
    models.preset("tiny", loss_chunk=-8)


def test_parallelism_checks():
  mesh = dion_jax.make_mesh("pp=2", jax.devices()[:2])
  with pytest.raises(ValueError, match="multiples of pp=2"):
    models.Parallelism(mesh, microbatches=3)
  with pytest.raises(ValueError, match="needs a pipeline"):
    models.Parallelism(None, virtual_stages=2)
  tp4 = dion_jax.make_mesh("tp=4", jax.devices()[:4])
  with pytest.raises(ValueError, match="tp=4 does not divide num_heads=2"):
    models.init(models.preset("tiny", num_heads=2), models.Parallelism(tp4))
