"""Hugging Face Llama, Qwen3 and Qwen3-MoE checkpoints imported into the GPT: transformers
(PyTorch, CPU) is the independent reference. Tiny random models are built from configs (no
download) and written with ``save_pretrained``."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dion_jax
import models
from models import hf as hf_map
from tests import extras
from train import sample
from train.store import hf as hf_io

torch = pytest.importorskip("torch", reason=extras.TORCH)
transformers = pytest.importorskip("transformers", reason="the Hugging Face reference tests need the dev extra: pip install -e \".[dev]\"")

SEQ = 12
COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
ARCHS = {
    # vocab 200: padded to 256, its padding masked; GQA 4 query heads over 2 kv heads;
    # Llama 3.1's rope scaling (with a context of 16, all of its three bands in use)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              {"vocab_size": 200, "tie_word_embeddings": False,
               "rope_scaling": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    # an explicit head_dim (32 != 64 / 4), QK-norm with scales, tied embeddings
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              {"vocab_size": 256, "head_dim": 32, "tie_word_embeddings": True}),
    # 4 experts of width 32 on every layer, 2 per token with renormalized gates; untied
    # vocab 200; transformers' reference loop over experts
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {"vocab_size": 200, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "router_aux_loss_coef": 0.02, "experts_implementation": "eager"}),
}
# experts on layers 1 and 3 only, dense MLPs (of another width, 96) on layers 0 and 2
# and a vocabulary of 47 (padded to 128): on tp=2 the second half of the table is all padding
ARCHS["qwen3_moe_every_2"] = (*ARCHS["qwen3_moe"][:2],
                              {**ARCHS["qwen3_moe"][2], "decoder_sparse_step": 2, "num_hidden_layers": 4,
                               "vocab_size": 47})
# MoE layers do not run on cp yet (models/moe.py).
MESHES = {"llama": "fs=2,tp=2,pp=2", "qwen3": "fs=2,tp=2,pp=2", "qwen3_moe": "fs=2,ep=2,tp=2",
          "qwen3_moe_every_2": "ep=2,tp=2,pp=2"}


def make_hf_model(arch: str, directory, seed: int = 0, **overrides):
  """A random tiny ``arch`` model saved in ``directory``; returns the torch model."""
  config_cls, model_cls, extra = ARCHS[arch]
  torch.manual_seed(seed)
  config = config_cls(**{**COMMON, **extra, **overrides}, attn_implementation="eager")
  model = model_cls(config).eval()
  with torch.no_grad():  # random norm scales, so that a misplaced scale shows
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.5 * torch.randn_like(p))
      # routers far from uniform and experts larger than the 0.02 init: a misrouted token shows
      elif ".mlp.gate.weight" in name or ".mlp.experts." in name:
        p.normal_(0, 0.3 if ".gate." in name else 0.1)
  model.save_pretrained(directory, safe_serialization=True)
  return model


def hf_logits(model, tokens_BxT: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BxT, dtype=torch.long)).logits.double().numpy()


def tokens(vocab: int, seed: int = 0, batch: int = 4) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (batch, SEQ + 1)).astype(np.int32)


def np_loss(logits_BxTxV: np.ndarray, targets_BxT: np.ndarray) -> float:
  m = logits_BxTxV.max(-1, keepdims=True)
  lse = np.log(np.exp(logits_BxTxV - m).sum(-1)) + m[..., 0]
  return float(np.mean(lse - np.take_along_axis(logits_BxTxV, targets_BxT[..., None], -1)[..., 0]))


def our_logits(cfg, graphdef, params, tokens_BxT) -> np.ndarray:
  params = dict(params, blocks=models.to_layers(params["blocks"], 1))
  return np.asarray(sample.logits(graphdef, params, jnp.asarray(tokens_BxT)))[..., :cfg.vocab_size]


@pytest.mark.parametrize("arch", ARCHS)
def test_import_matches_transformers_logits(tmp_path, arch):
  model = make_hf_model(arch, tmp_path)
  cfg = hf_io.model_config(str(tmp_path), seq_len=SEQ)
  assert cfg.kv_heads == 2 and cfg.mlp == "swiglu"
  assert (cfg.rope_llama3 is not None) == (arch == "llama")
  graphdef, params = hf_io.load(str(tmp_path), cfg, models.Parallelism())
  t = tokens(cfg.vocab_size)[:, :-1]
  np.testing.assert_allclose(our_logits(cfg, graphdef, params, t), hf_logits(model, t), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_import_on_mesh(tmp_path, arch):
  """Read onto ``MESHES[arch]`` slice by slice: the same arrays as on one device, and the
  mesh's loss (with sequence parallelism; without the router's auxiliary losses) is
  transformers' loss."""
  model = make_hf_model(arch, tmp_path)
  cfg = hf_io.model_config(str(tmp_path), seq_len=SEQ)
  mesh = dion_jax.make_mesh(MESHES[arch], jax.devices()[:8])
  par = models.Parallelism(mesh, sequence_parallel=True, microbatches=2)
  graphdef, params = hf_io.load(str(tmp_path), cfg, par)
  _, single = hf_io.load(str(tmp_path), cfg, models.Parallelism())
  layered = dict(params, blocks=models.to_layers(params["blocks"], par.pp))
  single = dict(single, blocks=models.to_layers(single["blocks"], 1))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), layered, single)
  t = tokens(cfg.vocab_size)
  batch = {"inputs": jnp.asarray(t[:, :-1]), "targets": jnp.asarray(t[:, 1:])}
  with jax.set_mesh(mesh):
    loss, aux = jax.jit(lambda p, b: models.loss(graphdef, p, b, par, aux=True))(params, batch)
  assert float(loss - aux.router_loss) == pytest.approx(np_loss(hf_logits(model, t[:, :-1]), t[:, 1:]), rel=1e-5)


def test_kv_heads_must_split_over_tp(tmp_path):
  make_hf_model("llama", tmp_path, num_key_value_heads=1)
  cfg = hf_io.model_config(str(tmp_path), seq_len=SEQ)
  mesh = dion_jax.make_mesh("tp=2", jax.devices()[:2])
  with pytest.raises(ValueError, match="num_kv_heads=1"):
    hf_io.load(str(tmp_path), cfg, models.Parallelism(mesh))


def test_unsupported_checkpoints_are_named():
  base = {**COMMON, "vocab_size": 10, "architectures": ["LlamaForCausalLM"]}
  with pytest.raises(hf_map.UnsupportedCheckpoint, match="GPT2LMHeadModel"):
    hf_map.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]}, seq_len=8)
  with pytest.raises(hf_map.UnsupportedCheckpoint, match="rope type='yarn'"):
    hf_map.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, seq_len=8)
  with pytest.raises(hf_map.UnsupportedCheckpoint, match="no Llama or Qwen3"):
    hf_map.to_hf_config(models.preset("tiny"))
  # Qwen3-MoE with dense layers we do not place, a shared expert or no expert
  moe = {**base, **ARCHS["qwen3_moe"][2], "architectures": ["Qwen3MoeForCausalLM"]}
  for field, value in (("decoder_sparse_step", 3), ("mlp_only_layers", [1]),
                       ("shared_expert_intermediate_size", 64), ("num_experts", 0)):
    with pytest.raises(hf_map.UnsupportedCheckpoint, match=re.escape(f"{field}={value}")):
      hf_map.from_hf_config({**moe, field: value}, seq_len=8)
  cfg = hf_map.from_hf_config(moe, seq_len=8)
  for change in ({"moe_shared_expert": True}, {"qk_norm": "none"}):
    with pytest.raises(hf_map.UnsupportedCheckpoint, match="no Qwen3-MoE"):
      hf_map.to_hf_config(dataclasses.replace(cfg, **change))


def test_qwen3_moe_config_both_ways():
  """transformers' config (which writes num_experts as its alias num_local_experts) gives the
  MoE fields; ours reads back the same and loads in transformers."""
  config_cls, _, extra = ARCHS["qwen3_moe"]
  hf = config_cls(**{**COMMON, **extra}, architectures=["Qwen3MoeForCausalLM"]).to_dict()
  assert "num_local_experts" in hf
  cfg = hf_map.from_hf_config(hf, seq_len=8)
  assert (cfg.num_experts, cfg.moe_top_k, cfg.d_expert, cfg.moe_renormalize, cfg.moe_capacity_factor) == (4, 2, 32, True, None)
  assert (cfg.moe_every, cfg.d_mlp) == (1, 96)  # intermediate_size: the width of dense layers
  assert (cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff, cfg.qk_norm) == (0.02, 0.0, "rms_scale")
  out = hf_map.to_hf_config(cfg, hf)
  assert hf_map.from_hf_config(out, seq_len=8) == cfg and "num_local_experts" not in out
  back = config_cls.from_dict(out)
  assert (back.num_experts, back.num_experts_per_tok, back.moe_intermediate_size, back.norm_topk_prob) == (4, 2, 32, True)
  # training options replace the checkpoint's
  tuned = hf_map.from_hf_config(hf, seq_len=8, moe_capacity_factor=1.5, moe_aux_loss_coeff=0.1)
  assert (tuned.moe_capacity_factor, tuned.moe_aux_loss_coeff) == (1.5, 0.1)


def test_default_labels_route_the_new_matrices():
  """gate/up/down and GQA's narrower key/value are matrices for Dion and its family; the
  QK-norm scales, norms and the (tied) embedding go to the scalar optimizer."""
  cfg = hf_map.from_hf_config({**COMMON, **ARCHS["qwen3"][2], "architectures": ["Qwen3ForCausalLM"]}, seq_len=8)
  labels = hf_map.flatten(dion_jax.default_labels(jax.eval_shape(lambda: models.init(cfg)[1])))
  matrices = {p for p, label in labels.items() if label == "dion"}
  assert matrices == {f"blocks/attn/{n}/kernel" for n in ("query", "key", "value", "out")} | {
      f"blocks/mlp/{n}/kernel" for n in ("gate", "up", "down")}
  assert labels["embed/embedding"] == "adamw" and "lm_head/kernel" not in labels
  assert labels["blocks/attn/query_norm/scale"] == "adamw"
