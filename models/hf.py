"""Hugging Face Llama, Qwen3 and Qwen3-MoE checkpoints as :class:`GPTConfig` options, and
their tensors as our parameter leaves (and back), in NumPy: no torch, no file format here.

Configs: :func:`from_hf_config` maps a ``config.json`` dict (``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``) onto a :class:`GPTConfig`; :func:`to_hf_config`
writes one back.

Tensors. Every parameter leaf of the GPT (``models/gpt.py``'s tree) is read from one
Hugging Face tensor per layer (per layer and expert for the experts):

    embed/embedding                   model.embed_tokens.weight          [V, D]
    blocks/attn_norm/scale            model.layers.{i}.input_layernorm.weight
    blocks/attn/{query,key,value,out}/kernel   ...self_attn.{q,k,v,o}_proj.weight (transposed)
    blocks/attn/{query,key}_norm/scale         ...self_attn.{q,k}_norm.weight (Qwen3)
    blocks/mlp_norm/scale             model.layers.{i}.post_attention_layernorm.weight
    blocks/mlp/{gate,up,down}/kernel  model.layers.{i}.mlp.{gate,up,down}_proj.weight (transposed)
    blocks/mlp/router/kernel          model.layers.{i}.mlp.gate.weight (transposed; Qwen3-MoE)
    blocks/mlp/experts/{gate,up,down} model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
                                      (expert e of [.., E, fan_in, fan_out], transposed; Qwen3-MoE)
    blocks/{dense,moe}/...            the same, for layers in groups (below)
    final_norm/scale                  model.norm.weight
    lm_head/kernel                    lm_head.weight (transposed; absent when tied)

with three changes of form, each exact: torch's ``(fan_out, fan_in)`` weights become Flax's
``(fan_in, fan_out)`` kernels; the vocabulary is padded with zero rows to
``padded_vocab`` (and those rows masked out of the softmax: ``mask_vocab_padding``); and
the second half of every query and key head changes sign. Our rotary embedding rotates
each pair (x[i], x[i + H/2]) by minus the angle (the reference's convention), Hugging
Face's by plus it; negating x[i + H/2] of both query and key maps one onto the other and
leaves every query-key product, hence the model, unchanged (QK-norm scales are per
dimension and commute with it).

Qwen3-MoE's routing is ours (``models/moe.py``: softmax over all experts in float32, top-k,
``norm_topk_prob`` renormalizes), without a shared expert. Its ``decoder_sparse_step`` n is
our ``moe_every``: layer i has experts (of width ``moe_intermediate_size``) when n divides
i + 1, a dense MLP (of width ``intermediate_size``) otherwise; our layers then run in groups
of n, and layer g·n + j is the group g's dense layer j (``blocks/dense``, j < n − 1) or its
mixture (``blocks/moe``, j = n − 1). ``mlp_only_layers``, a step that does not divide the
layers, or a shared expert are refused. The experts are stored one tensor per expert, as on the Hub and as transformers'
``save_pretrained`` writes them (it fuses them into ``gate_up_proj`` in memory only).
``router_aux_loss_coef`` becomes ``moe_aux_loss_coeff``, the weight of our balance loss
(per layer and sequence, where transformers pools layers and batch), and the z-loss,
which Qwen3-MoE lacks, is off; a capacity factor is a training choice the export drops
(transformers routes every token).

:func:`read_leaf` assembles any slice of a leaf from slices of the tensors, so that a
process reads only what its devices hold (``train/store/hf.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from models.config import GPTConfig
from models.sharding import to_stages

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}

# leaf path (without "blocks/") -> Hugging Face name, with {i} the layer.
_LAYER_NAMES = {
    "attn_norm/scale": "model.layers.{i}.input_layernorm.weight",
    "attn/query/kernel": "model.layers.{i}.self_attn.q_proj.weight",
    "attn/key/kernel": "model.layers.{i}.self_attn.k_proj.weight",
    "attn/value/kernel": "model.layers.{i}.self_attn.v_proj.weight",
    "attn/out/kernel": "model.layers.{i}.self_attn.o_proj.weight",
    "attn/query_norm/scale": "model.layers.{i}.self_attn.q_norm.weight",
    "attn/key_norm/scale": "model.layers.{i}.self_attn.k_norm.weight",
    "mlp_norm/scale": "model.layers.{i}.post_attention_layernorm.weight",
}
_MLP_NAMES = {
    "mlp/gate/kernel": "model.layers.{i}.mlp.gate_proj.weight",
    "mlp/up/kernel": "model.layers.{i}.mlp.up_proj.weight",
    "mlp/down/kernel": "model.layers.{i}.mlp.down_proj.weight",
}
# {e}: the expert.
_MOE_NAMES = {
    "mlp/router/kernel": "model.layers.{i}.mlp.gate.weight",
    "mlp/experts/gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "mlp/experts/up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "mlp/experts/down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
}
_TOP_NAMES = {
    "embed/embedding": "model.embed_tokens.weight",
    "final_norm/scale": "model.norm.weight",
    "lm_head/kernel": "lm_head.weight",
}
_ROTATED = ("attn/query/kernel", "attn/key/kernel")


class UnsupportedCheckpoint(ValueError):
  """A Hugging Face checkpoint this model cannot represent (one line: what and why)."""


def from_hf_config(hf: dict, *, seq_len: int, dtype: str = "float32", **options) -> GPTConfig:
  """The :class:`GPTConfig` of a Hugging Face ``config.json`` dict.

  Args:
    hf: the parsed config.json.
    seq_len: training sequence length (a checkpoint only records its maximum).
    dtype: compute dtype.
    options: other GPTConfig fields (remat, attention, unroll); a mixture of experts'
      training options (moe_capacity_factor, moe_aux_loss_coeff, moe_z_loss_coeff) replace
      the checkpoint's.

  Raises:
    UnsupportedCheckpoint: another architecture, or an option we do not implement.
  """
  archs = hf.get("architectures") or []
  kind = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if kind is None:
    raise UnsupportedCheckpoint(f"architecture {archs or hf.get('model_type')} is not supported;"
                                f" supported: {', '.join(ARCHITECTURES)}")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  checks = {
      "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
      "attention_bias": (bool(hf.get("attention_bias", False)), False),
      "mlp_bias": (bool(hf.get("mlp_bias", False)), False),
      "rope type": (rope_type if rope_type != "llama3" else "default", "default"),
      "use_sliding_window": (bool(hf.get("use_sliding_window", False)), False),
  }
  moe = {}
  if kind == "qwen3_moe":
    # transformers saves num_experts under its alias num_local_experts; the Hub's files use num_experts.
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    if experts < 1:
      raise UnsupportedCheckpoint(f"{archs[0]} with num_experts={experts} (no expert) is not supported")
    # Mixtures on every n-th layer (moe_every), none shared.
    step = hf.get("decoder_sparse_step", 1)
    if step < 1 or hf["num_hidden_layers"] % step:
      raise UnsupportedCheckpoint(f"{archs[0]} with decoder_sparse_step={step} is not supported for"
                                  f" {hf['num_hidden_layers']} layers (only steps that divide them)")
    checks.update({
        "mlp_only_layers": (list(hf.get("mlp_only_layers") or []), []),
        "shared_expert_intermediate_size": (hf.get("shared_expert_intermediate_size") or 0, 0),
    })
    moe = {"num_experts": experts, "moe_top_k": hf["num_experts_per_tok"], "moe_every": step,
           "moe_mlp_dim": hf["moe_intermediate_size"],
           "moe_renormalize": bool(hf.get("norm_topk_prob", False)),
           "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)), "moe_z_loss_coeff": 0.0}
  for name, (got, want) in checks.items():
    if got != want:
      raise UnsupportedCheckpoint(f"{archs[0]} with {name}={got!r} is not supported (only {want!r})")
  theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
  llama3 = None
  if rope_type == "llama3":
    llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
              int(rope["original_max_position_embeddings"]))
  heads = hf["num_attention_heads"]
  return GPTConfig(
      vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"],
      mlp="swiglu", qk_norm="none" if kind == "llama" else "rms_scale",
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_base=float(theta), rope_llama3=llama3,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), mask_vocab_padding=True,
      seq_len=seq_len, dtype=dtype, **{**moe, **options})


def _export_kind(cfg: GPTConfig) -> str:
  """The :data:`ARCHITECTURES` kind ``cfg`` exports as.

  Raises:
    UnsupportedCheckpoint: no Llama, Qwen3 or Qwen3-MoE (the reference GPT's ReLU² MLP and
      unscaled QK-norm, a mixture of experts without QK-norm scales or with a shared
      expert have no Hugging Face architecture here).
  """
  if cfg.mlp != "swiglu" or cfg.qk_norm == "rms":
    raise UnsupportedCheckpoint(
        f"this model (mlp={cfg.mlp}, qk_norm={cfg.qk_norm}) is no Llama or Qwen3: only models"
        " with mlp=swiglu and qk_norm none (Llama) or rms_scale (Qwen3) export; train one with"
        " python -m train.gpt --mlp swiglu --qk-norm none (or rms_scale), or start from --init-from hf:DIR")
  if not cfg.num_experts:
    return "qwen3" if cfg.qk_norm == "rms_scale" else "llama"
  if cfg.qk_norm != "rms_scale" or cfg.moe_shared_expert:
    raise UnsupportedCheckpoint(
        f"this mixture of experts (qk_norm={cfg.qk_norm}, moe_shared_expert={cfg.moe_shared_expert})"
        " is no Qwen3-MoE: only mixtures with qk_norm rms_scale and no shared expert export")
  return "qwen3_moe"


def to_hf_config(cfg: GPTConfig, base: dict | None = None) -> dict:
  """A ``config.json`` dict for ``cfg``: ``base`` (the imported checkpoint's, keeping its
  token ids and the like) with our fields written over it.

  Raises:
    UnsupportedCheckpoint: ``cfg`` is no Llama, Qwen3 or Qwen3-MoE (:func:`_export_kind`).
  """
  kind = _export_kind(cfg)
  out = dict(base or {})
  out.pop("rope_scaling", None)
  out.update(
      architectures=[next(a for a, k in ARCHITECTURES.items() if k == kind)], model_type=kind,
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
      hidden_act="silu", rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_base,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, torch_dtype="float32")
  if cfg.rope_llama3 is not None:
    factor, low, high, context = cfg.rope_llama3
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": context}
    out["rope_parameters"] = {**scaling, "rope_theta": cfg.rope_base}
    out["rope_scaling"] = scaling
  out.setdefault("max_position_embeddings", cfg.seq_len)
  if kind == "llama":
    out["mlp_bias"] = False
  if kind == "qwen3_moe":
    # num_local_experts, transformers' alias, would win over num_experts.
    out.pop("num_local_experts", None)
    out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k,
               moe_intermediate_size=cfg.d_expert, norm_topk_prob=cfg.moe_renormalize,
               router_aux_loss_coef=cfg.moe_aux_loss_coeff, decoder_sparse_step=cfg.moe_every,
               mlp_only_layers=[])
  out["intermediate_size"] = cfg.d_mlp
  return out


@dataclasses.dataclass(frozen=True)
class LeafSource:
  """Where one parameter leaf comes from.

  Attributes:
    names: the Hugging Face tensor of each layer of the stack (one name when not stacked);
      of each layer and expert, layer-major, for an expert leaf.
    transpose: the tensor is torch's (fan_out, fan_in) of our (fan_in, fan_out) kernel.
    head_dim: flip the sign of the second half of each head of the kernel's columns
      (query and key; 0: none).
    padded_axis: our axis holding the vocabulary, padded with zeros past ``vocab``.
    vocab: the real vocabulary size.
    inner: the size of a stacked leaf's axis after its layer axes when that axis too holds
      one tensor each: E for the experts ``[.., E, fan_in, fan_out]``, moe_every − 1 for a
      group's dense layers ``[.., moe_every − 1, ...]``; else 0.
  """
  names: tuple[str, ...]
  transpose: bool
  head_dim: int = 0
  padded_axis: int | None = None
  vocab: int = 0
  inner: int = 0


def leaf_sources(cfg: GPTConfig) -> dict[str, LeafSource]:
  """The :class:`LeafSource` of every leaf, by its '/'-joined path (blocks in layer order)."""
  out = {}
  for path, name in _TOP_NAMES.items():
    if path == "lm_head/kernel" and cfg.tie_embeddings:
      continue
    padded = {"embed/embedding": 0, "lm_head/kernel": 1}.get(path)
    out[path] = LeafSource((name,), path.endswith("kernel"), padded_axis=padded, vocab=cfg.vocab_size)
  n = cfg.group_size
  if n == 1:
    out.update(_layer_sources(cfg, "blocks/", range(cfg.num_layers), bool(cfg.num_experts), 0))
  else:  # layer g·n + j: group g's dense layer j, or (j = n − 1) its mixture
    groups = range(cfg.num_layers // n)
    dense = [g * n + j for g in groups for j in range(n - 1)]
    out.update(_layer_sources(cfg, "blocks/dense/", dense, False, n - 1))
    out.update(_layer_sources(cfg, "blocks/moe/", [g * n + n - 1 for g in groups], True, 0))
  return out


def _layer_sources(cfg: GPTConfig, prefix: str, layers: list[int], experts: bool, inner: int
                   ) -> dict[str, LeafSource]:
  """The sources of a stack of ``layers`` (Hugging Face indices, in stack order), with a
  mixture of experts or a dense MLP; ``inner`` dense layers per row of the stack."""
  out = {}
  for path, name in {**_LAYER_NAMES, **(_MOE_NAMES if experts else _MLP_NAMES)}.items():
    if (("gate" in path and cfg.mlp != "swiglu")
        or ("_norm/" in path and path.startswith("attn/") and cfg.qk_norm != "rms_scale")):
      continue
    per_layer = cfg.num_experts if "{e}" in name else 1
    names = tuple(name.format(i=i, e=e) for i in layers for e in range(per_layer))
    out[prefix + path] = LeafSource(names, not path.endswith("/scale"),
                                    head_dim=cfg.head_dim if path in _ROTATED else 0,
                                    inner=cfg.num_experts if "{e}" in name else inner)
  return out


def hf_shape(source: LeafSource, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of each Hugging Face tensor of a leaf of ``shape`` without its layer axes
  (with its inner axis: experts, or a group's dense layers)."""
  shape = list(shape[1:] if source.inner else shape)
  if source.padded_axis is not None:
    shape[source.padded_axis] = source.vocab
  return tuple(reversed(shape)) if source.transpose else tuple(shape)


def _head_signs(columns: slice, head_dim: int) -> np.ndarray:
  c = np.arange(columns.start, columns.stop)
  return np.where(c % head_dim >= head_dim // 2, -1.0, 1.0).astype(np.float32)


def read_core(source: LeafSource, name: str, index: tuple[slice, ...], shape: tuple[int, ...],
              get: Callable[[str, tuple[slice, ...]], np.ndarray]) -> np.ndarray:
  """Slice ``index`` of one (non-stacked) leaf of global ``shape`` as float32, from
  ``get(name, hf_index)``, which reads a slice of a Hugging Face tensor."""
  index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
  want = tuple(s.stop - s.start for s in index)
  read = list(index)
  if source.padded_axis is not None:  # rows past the vocabulary are padding: zeros
    s = index[source.padded_axis]
    if s.start >= source.vocab:  # all padding (a tp shard past the vocabulary): nothing to read
      return np.zeros(want, np.float32)
    read[source.padded_axis] = slice(s.start, min(s.stop, source.vocab))
  hf_index = tuple(read[::-1]) if source.transpose else tuple(read)
  x = np.asarray(get(name, hf_index)).astype(np.float32)
  if source.transpose:
    x = x.T
  if x.shape != want:
    x = np.pad(x, [(0, w - g) for w, g in zip(want, x.shape)])
  if source.head_dim:
    x = x * _head_signs(index[-1], source.head_dim)
  return x


def read_leaf(source: LeafSource, index: tuple[slice, ...], shape: tuple[int, ...], pp: int,
              virtual_stages: int, get: Callable[[str, tuple[slice, ...]], np.ndarray]) -> np.ndarray:
  """Slice ``index`` of a leaf of global ``shape``: stacked leaves ``(stages, layers per
  stage, ...)`` in ``pp``'s stage layout (:func:`models.to_stages`), expert leaves
  ``(stages, layers per stage, experts, ...)``, others as they are."""
  if not is_stacked(source):
    return read_core(source, source.names[0], index, shape, get)
  inner = max(source.inner, 1)
  layer_ids = to_stages(np.arange(len(source.names) // inner), pp, virtual_stages)  # [S, Ls]
  ids = layer_ids[index[0], index[1]]  # [s, l]: into names
  axes = 2
  if source.inner:  # [s, l, e]
    ids = ids[..., None] * inner + np.arange(inner)[index[2]]
    axes = 3
  core_index, core_shape = index[axes:], shape[axes:]
  out = None
  for pos in np.ndindex(*ids.shape):  # filled tensor by tensor: no second copy of the slice
    x = read_core(source, source.names[ids[pos]], core_index, core_shape, get)
    if out is None:
      out = np.empty(ids.shape + x.shape, np.float32)
    out[pos] = x
  return out


def is_stacked(source: LeafSource) -> bool:
  """Whether the leaf is a stack of layers (one tensor per layer, or per layer and expert)."""
  return source.names[0].startswith("model.layers.")


def to_hf_tensors(cfg: GPTConfig, params: Any) -> dict[str, Callable[[], np.ndarray]]:
  """Hugging Face tensors (float32) of host ``params`` whose blocks are in layer order
  ``[num_layers, ...]`` (``models.to_layers``), each made when called: a writer holds one
  file's tensors at a time beside the parameters, not a second copy of the model. The
  tensors come leaf by leaf, and a leaf needs only ``shape`` and indexing: it may be read
  from disk when first sliced (``train.export``)."""
  flat = flatten(params)
  unknown = set(flat) - set(leaf_sources(cfg))
  if unknown:
    raise UnsupportedCheckpoint(f"parameters {sorted(unknown)} have no Hugging Face tensor")

  def tensor(source: LeafSource, x: Any, at: tuple[int, ...]) -> Callable[[], np.ndarray]:
    def make():
      w = np.asarray(x[at], np.float32)
      if source.head_dim:
        w = w * _head_signs(slice(0, w.shape[-1]), source.head_dim)
      if source.padded_axis is not None:
        w = np.take(w, np.arange(cfg.vocab_size), axis=source.padded_axis)
      # A copy, never a view: a view would keep its whole (stacked) leaf alive.
      return np.array(w.T if source.transpose else w, order="C")
    return make

  out = {}
  for path, source in leaf_sources(cfg).items():
    x = flat[path]
    # the axes that index the tensors, in names' order: none, [L], [L, E] or [G, moe_every − 1]
    grid = np.shape(x)[:is_stacked(source) + bool(source.inner)]
    for name, at in zip(source.names, np.ndindex(*grid)):
      out[name] = tensor(source, x, at)
  return out


def hf_nbytes(cfg: GPTConfig, params: Any) -> dict[str, int]:
  """The float32 bytes of each tensor of :func:`to_hf_tensors`, without making it."""
  flat = flatten(params)
  out = {}
  for path, source in leaf_sources(cfg).items():
    shape = np.shape(flat[path])[1:] if is_stacked(source) else np.shape(flat[path])
    out.update(dict.fromkeys(source.names, 4 * int(np.prod(hf_shape(source, shape)))))
  return out


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Leaves of a nested dict by their '/'-joined path."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
  return out
