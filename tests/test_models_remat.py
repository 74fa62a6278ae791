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


@pytest.mark.parametrize("bad, problem", [
    ("partial", "unknown"), ("custom:", "a NAME=PLACE is missing"), ("custom:query_proj", "'query_proj' has no PLACE"),
    ("custom:query=host", "'query' is no tensor NAME"), ("custom:query_proj=disk", "'query_proj=disk' has no PLACE")])
def test_an_unknown_policy_is_one_line_naming_the_policies(bad, problem):
  with pytest.raises(ValueError) as e:
    models.preset("tiny", remat=bad)
  message = str(e.value)
  assert "\n" not in message and "save_qkv_proj" in message and "custom:NAME=PLACE" in message
  assert message.startswith(f"recompute policy (--remat) {bad!r}: {problem}")


def test_saved_booleans_read_as_full_and_none():
  assert models.preset("tiny", remat=True).remat == "full"
  assert models.preset("tiny", remat=False).remat == "none"
  assert models.GPTConfig().remat == "none"


# --- every policy computes none's loss and gradients, and keeps what it names ---------------

# A mixture of experts with SwiGLU (every expert tag), a shared expert and a dense layer
# before it (a Group).
MOE = models.preset("tiny-moe", num_layers=2, d_model=32, num_heads=2, seq_len=16, mlp_dim=32, num_experts=4,
                    mlp="swiglu", moe_every=2, moe_shared_expert=True)


def _with(cfg, policy, **options):
  return dataclasses.replace(cfg, remat=policy, **options)


def _compiled_grad(cfg, batch):
  graphdef, _ = models.init(cfg)
  return jax.jit(jax.value_and_grad(lambda p: models.loss(graphdef, p, batch)))


@pytest.fixture(scope="module")
def reference():
  return {"dense": model_meshes.one_device(CFG, _batch()), "moe": model_meshes.one_device(MOE, _batch(MOE))}


def _kept_bytes_per_layer(policy, cfg=CFG, batch=BATCH * 2):
  """float32 bytes of the tensors ``policy`` keeps per dense layer, from the shapes of the
  model's docstring: [B, T, D] each but the MLP's [B, T, 4D]; ``none`` adds the scores
  [B, N, T, T]."""
  row = batch * cfg.seq_len * cfg.d_model * 4
  width = {"mlp_up": 4, "mlp_gate": 4}
  kept = {"none": ["layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj", "mlp_up"],
          "full": ["layer_input"], "save_qkv_proj": ["layer_input", "query_proj", "key_proj", "value_proj"],
          "selective": ["layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj", "mlp_up"]}
  scores = batch * cfg.num_heads * cfg.seq_len ** 2 * 4 if policy == "none" else 0
  return sum(row * width.get(name, 1) for name in kept[policy]) + scores


@pytest.mark.parametrize("policy", ["none", "full", "save_qkv_proj", "selective"])
def test_compiled_temporaries_grow_per_layer_by_what_the_policy_keeps(reference, policy):
  """Two more layers add to the compiled gradient's temporaries exactly the bytes of the
  tensors the policy keeps per layer (measured: equal to the byte; 1% allowed for XLA's
  alignment), and the 2-layer program computes ``none``'s loss and gradients (another
  compiled program: within float32 rounding, measured 0 on this CPU)."""
  batch = _batch()
  compiled = {}
  for layers in (2, 4):
    cfg = _with(CFG, policy, num_layers=layers)
    compiled[layers] = _compiled_grad(cfg, batch).lower(jax.eval_shape(lambda: models.init(cfg)[1])).compile()
  temp = {layers: c.memory_analysis().temp_size_in_bytes for layers, c in compiled.items()}
  np.testing.assert_allclose((temp[4] - temp[2]) / 2, _kept_bytes_per_layer(policy), rtol=1e-2)
  loss, grads = compiled[2](models.init(CFG)[1])
  _, want_loss, want_grads = reference["dense"]
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
  model_meshes.assert_close_trees(grads, want_grads, rtol=1e-5)


@pytest.mark.parametrize("policy", ["selective", "custom:layer_input=host,attention_out=device,expert_down=host"])
def test_moe_policies_match_none(reference, policy):
  """The experts' tags on one device (a mesh's dispatch re-runs the experts in its own
  backward pass), beside a dense layer and a shared expert."""
  batch = _batch(MOE)
  loss, grads = _compiled_grad(_with(MOE, policy), batch)(models.init(MOE)[1])
  _, want_loss, want_grads = reference["moe"]
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
  model_meshes.assert_close_trees(grads, want_grads, rtol=1e-5)


# pp (inside the pipeline's shard_map), cp with tp and sequence parallelism: a policy keeping
# tensors on the device and one moving them to the host.
MESHES = [("fs=2,tp=2,pp=2", {"microbatches": 2}, "minimal_offloaded"),
          ("cp=2,tp=2", {"sequence_parallel": True}, "selective")]


@pytest.mark.parametrize("spec,options,policy", MESHES, ids=[f"{m[0]}-{m[2]}" for m in MESHES])
def test_policies_on_meshes_match_none_on_one_device(reference, spec, options, policy):
  model_meshes.assert_mesh_matches(reference["dense"], _with(CFG, policy), _batch(), spec, options)


def test_offloaded_policies_move_their_tensors_to_pinned_host_memory_on_a_gpu():
  """XLA:CPU lowers a move to host memory inside a computation to nothing (``models/remat.py``),
  so this reads the program JAX builds for CUDA: one move out and one back per tensor the
  backward pass reads, q, k, v, the out projection and the MLP's up product (relu2: no gate),
  inside the layer scan; none where the policy keeps everything on the device."""
  batch = _batch()
  for policy, moved in (("minimal_offloaded", 5), ("qkv_proj_offloaded", 3), ("selective", 0)):
    params = jax.eval_shape(lambda: models.init(CFG)[1])
    text = export.export(_compiled_grad(_with(CFG, policy), batch), platforms=("cuda",))(params).mlir_module()
    assert text.count('_xla_buffer_placement = "pinned_host"') == moved, policy
    assert text.count('_xla_buffer_placement = "device"') == moved, policy


def test_help_describes_every_policy_the_model_has():
  from train.run import flags
  assert tuple(flags.REMAT_POLICIES) == tuple(remat.POLICIES)
  help_text = flags.HELP["remat"]
  assert all(f"{name}: " in help_text for name in remat.POLICIES)
  assert all(name in help_text for name in remat.NAMES if name != "mlp_down")
