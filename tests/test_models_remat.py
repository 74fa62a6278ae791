"""Recompute policies: the table, the same loss and gradients as ``none`` under every
policy, and compiled programs that keep exactly what each policy names."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import models
from models import remat
from tests import model_meshes

CFG = models.preset("tiny", num_layers=2, d_model=64, num_heads=4, seq_len=32)
BATCH = 4


def _batch(cfg=CFG, seed=0):
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (BATCH * 2, cfg.seq_len + 1))
  return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def test_placements_name_what_each_policy_keeps():
  """Written out from Megatron-LM's and MaxText's definitions, not read from the table."""
  qkv = {"query_proj": "device", "key_proj": "device", "value_proj": "device"}
  assert remat.placements("full") == {"layer_input": "device"}
  assert remat.placements("save_qkv_proj") == {"layer_input": "device", **qkv}
  assert remat.placements("save_out_proj") == {"layer_input": "device", "out_proj": "device"}
  assert remat.placements("save_dot_except_mlp") == {"layer_input": "device", **qkv, "out_proj": "device"}
  assert remat.placements("selective") == {
      "layer_input": "device", **qkv, "attention_out": "device", "out_proj": "device", "mlp_gate": "device",
      "mlp_up": "device", "expert_gate": "device", "expert_up": "device", "expert_down": "device"}
  assert remat.placements("qkv_proj_offloaded") == {"layer_input": "device", **dict.fromkeys(qkv, "host")}
  assert remat.placements("custom:query_proj=host, mlp_up=device,mlp_down=host") == {
      "layer_input": "device", "query_proj": "host", "mlp_up": "device"}
  assert remat.placements("custom:layer_input=host") == {"layer_input": "host"}
  assert set(remat.placements("none")) == {"layer_input", *qkv, "attention_out", "out_proj", "mlp_gate", "mlp_up"}


@pytest.mark.parametrize("bad", ["partial", "custom:", "custom:query_proj", "custom:query=host",
                                 "custom:query_proj=disk"])
def test_an_unknown_policy_is_one_line_naming_the_policies(bad):
  with pytest.raises(ValueError) as e:
    models.preset("tiny", remat=bad)
  message = str(e.value)
  assert "\n" not in message and "save_qkv_proj" in message and "custom:NAME=PLACE" in message


def test_saved_booleans_read_as_full_and_none():
  assert models.preset("tiny", remat=True).remat == "full"
  assert models.preset("tiny", remat=False).remat == "none"
  assert models.GPTConfig().remat == "none"
