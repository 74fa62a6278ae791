"""The GPT's configuration and its presets, in one place.

    cfg = models.preset("tiny")                        # 4 x 128, seq 128
    cfg = models.preset("small", num_layers=6)         # any field can be overridden

The presets follow microsoft/dion's GPT: pre-norm RMSNorm, rotary embeddings, QK-norm,
ReLU² MLP (4x), untied embedding and LM head, no biases. Options of the same model cover
Llama 3 (``mlp="swiglu"``, grouped-query attention with ``num_kv_heads``, ``qk_norm="none"``,
``tie_embeddings``) and Qwen3 (Llama with ``qk_norm="rms_scale"`` and an explicit
``head_dim``); ``models/hf.py`` maps Hugging Face configs onto them.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from models import fp8 as fp8_lib
from models import remat as remat_lib

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
MLP_KINDS = ("relu2", "swiglu")
# QK-norm: none (Llama), RMS without a scale after the rotary embedding (the reference),
# RMS with a learnable per-head-dim scale before it (Qwen3).
QK_NORMS = ("none", "rms", "rms_scale")
# torch's F.rms_norm with eps=None, as the reference calls it, uses float32's machine epsilon.
FLOAT32_EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape and numerics of the GPT.

  Attributes:
    vocab_size: tokens the data can hold; the embedding and LM head are padded to
      a multiple of 128 (:attr:`padded_vocab`).
    num_layers, d_model, num_heads: depth, width, attention (query) heads.
    num_kv_heads: key/value heads of grouped-query attention (None: num_heads); divides
      num_heads.
    head_dim: width of each head (None: d_model / num_heads, resolved at construction);
      even for the rotary embedding.
    seq_len: tokens per training sequence.
    mlp_ratio: hidden width of the MLP over d_model, unless ``mlp_dim`` is given.
    mlp_dim: hidden width of the MLP (None: mlp_ratio · d_model).
    mlp: ``"relu2"`` (the reference: up, ReLU², down) or ``"swiglu"`` (Llama: silu(gate)·up, down).
    qk_norm: one of :data:`QK_NORMS`.
    norm_eps: epsilon of every RMSNorm (default float32's machine epsilon, the reference's).
    tie_embeddings: the LM head is the embedding table's transpose (no ``lm_head`` parameter).
    mask_vocab_padding: the padded rows of the vocabulary get logit -inf, so that the loss
      and the softmax cover ``vocab_size`` tokens exactly (imported checkpoints, whose
      padding rows are zeros); the reference trains its padding rows instead.
    dtype: compute dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``; parameters
      and optimizer state stay float32, softmax and the loss run in float32. float16's
      narrow range needs loss scaling in training (``train/run/step.py``).
    remat: the recompute policy, what each layer keeps for its backward pass: a name of
      ``models.remat.POLICIES`` (``"none"``: every matrix product, ``"full"``: the layer's
      input only, ...) or ``"custom:NAME=PLACE,..."``; the booleans of configs saved before
      the names read as ``"full"`` (True) and ``"none"`` (False).
    fp8: the transformer blocks' matrix products (query, key, value, out projection, the
      dense MLP's, the shared expert's and the experts' grouped ones) in FP8, a recipe of
      ``models.fp8.RECIPES``: ``"none"``, ``"current"``: e4m3 inputs and weights, e5m2
      output gradients, each scaled by its own amax, float32 accumulation
      (``models/fp8.py``), or ``"delayed"``: each scaled by its amax history of the last
      steps (each product's ``fp8_history``, model state the trainer keeps apart from the
      parameters); the embedding, LM head, norms, attention's softmax, router and
      the loss stay in ``dtype``. True and False (a config file's) read as ``"current"`` and ``"none"``.
    loss_chunk: tokens of each device that go through the LM head and the loss at a time
      (``models/lm_head.py``): the peak holds one chunk's logits [loss_chunk, V/tp] and
      their softmax and gradient, not the whole batch's, for the head's product done
      twice; 0 forms all the logits at once.
    rope_base: base of the rotary embedding's frequencies.
    rope_llama3: Llama 3.1's frequency scaling for long contexts, ``(factor,
      low_freq_factor, high_freq_factor, original_max_position_embeddings)``, or None.
    attention: ``"xla"`` or ``"cudnn"``, the ``implementation`` of
      ``jax.nn.dot_product_attention``: cuDNN's fused (flash) attention needs an NVIDIA
      GPU and a 16-bit ``dtype``; XLA's runs everywhere and holds the T x T scores.
    unroll: unroll the layer scan and the pipeline's loop: longer compiles, and XLA's
      cost analysis (which counts a loop body once) then counts every iteration.
    num_experts: 0 for a dense MLP; else the MLP of every ``moe_every``-th layer is a
      mixture of this many experts, each an MLP of width :attr:`d_expert` (``models/moe.py``).
    moe_every: with experts, layer i (from 0) is a mixture of experts when (i + 1) is a
      multiple of this (Qwen3-MoE's ``decoder_sparse_step``), the others dense: 1 puts
      experts in every layer, 2 in every second one. Divides ``num_layers``; the layers
      run in groups of ``moe_every`` (:attr:`group_size`).
    moe_mlp_dim: hidden width of each expert and the shared expert (None: the dense
      MLP's, :attr:`d_mlp`).
    moe_top_k: experts per token.
    moe_capacity_factor: None routes every token (dropless); c caps each expert at
      ceil(c·seq_len·top_k / num_experts) assignments per sequence and drops the rest.
    moe_shared_expert: add a dense MLP of the experts' width that every token goes through.
    moe_renormalize: the top-k gates sum to 1 (Mixtral, Qwen3-MoE); else they are the
      router's probabilities.
    moe_aux_loss_coeff, moe_z_loss_coeff: weights of each MoE layer's load-balancing loss
      and router z-loss in the training loss.
  """

  vocab_size: int = 257
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 4
  seq_len: int = 128
  mlp_ratio: int = 4
  num_kv_heads: int | None = None
  head_dim: int | None = None
  mlp_dim: int | None = None
  mlp: str = "relu2"
  qk_norm: str = "rms"
  norm_eps: float = FLOAT32_EPS
  tie_embeddings: bool = False
  mask_vocab_padding: bool = False
  dtype: str = "float32"
  remat: str = "none"
  fp8: str = "none"
  loss_chunk: int = 0
  rope_base: float = 10000.0
  rope_llama3: tuple[float, float, float, int] | None = None
  attention: str = "xla"
  unroll: bool = False
  num_experts: int = 0
  moe_every: int = 1
  moe_mlp_dim: int | None = None
  moe_top_k: int = 2
  moe_capacity_factor: float | None = None
  moe_shared_expert: bool = False
  moe_renormalize: bool = True
  moe_aux_loss_coeff: float = 0.01
  moe_z_loss_coeff: float = 0.001

  def __post_init__(self):
    if isinstance(self.remat, bool):
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    remat_lib.placements(self.remat)  # a one-line ValueError naming the policies
    if isinstance(self.fp8, bool):
      object.__setattr__(self, "fp8", "current" if self.fp8 else "none")
    if self.fp8 not in fp8_lib.RECIPES:
      raise ValueError(f"GPTConfig.fp8 must be one of {fp8_lib.RECIPES}, got {self.fp8!r}")
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "seq_len", "mlp_ratio",
                 "num_kv_heads", "head_dim", "mlp_dim", "moe_mlp_dim"):
      value = getattr(self, name)
      if value is None and name in ("num_kv_heads", "head_dim", "mlp_dim", "moe_mlp_dim"):
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(
            f"GPTConfig: d_model {self.d_model} is not divisible by num_heads {self.num_heads};"
            " choose num_heads that divides d_model, or give head_dim")
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(
          f"GPTConfig: head size {self.head_dim} must be even for the rotary embedding;"
          " change d_model, num_heads or head_dim")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"GPTConfig: num_kv_heads {self.kv_heads} does not divide num_heads"
                       f" {self.num_heads}; each key/value head serves a whole group of queries")
    if self.mlp not in MLP_KINDS:
      raise ValueError(f"GPTConfig.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
    if self.qk_norm not in QK_NORMS:
      raise ValueError(f"GPTConfig.qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
    if self.rope_llama3 is not None:  # a JSON record gives a list: keep the config hashable
      if len(self.rope_llama3) != 4:
        raise ValueError(f"GPTConfig.rope_llama3 must be (factor, low_freq_factor,"
                         f" high_freq_factor, original_max_position_embeddings), got {self.rope_llama3!r}")
      object.__setattr__(self, "rope_llama3", tuple(self.rope_llama3))
    if not isinstance(self.num_experts, int) or self.num_experts < 0:
      raise ValueError(f"GPTConfig.num_experts must be 0 (dense) or a positive integer, got {self.num_experts!r}")
    if not isinstance(self.moe_every, int) or isinstance(self.moe_every, bool) or self.moe_every < 1:
      raise ValueError(f"GPTConfig.moe_every must be a positive integer, got {self.moe_every!r}")
    if self.moe_every > 1 and not self.num_experts:
      raise ValueError(f"GPTConfig: moe_every={self.moe_every} places mixtures of experts, but"
                       " num_experts is 0; give num_experts, or leave moe_every at 1")
    if self.num_layers % self.moe_every:
      raise ValueError(f"GPTConfig: moe_every={self.moe_every} does not divide num_layers="
                       f"{self.num_layers}; the layers run in groups of moe_every (dense ones,"
                       " then one with experts): choose sizes that divide")
    if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
      raise ValueError(f"GPTConfig: moe_top_k={self.moe_top_k} must be between 1 and num_experts="
                       f"{self.num_experts}")
    if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
      raise ValueError(f"GPTConfig.moe_capacity_factor must be > 0 or None (dropless), got"
                       f" {self.moe_capacity_factor!r}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"GPTConfig.{name} must be >= 0, got {getattr(self, name)!r}")
    if not isinstance(self.loss_chunk, int) or isinstance(self.loss_chunk, bool) or self.loss_chunk < 0:
      raise ValueError(f"GPTConfig.loss_chunk must be 0 (unchunked) or a positive number of tokens,"
                       f" got {self.loss_chunk!r}")
    if not self.norm_eps >= 0:
      raise ValueError(f"GPTConfig.norm_eps must be >= 0, got {self.norm_eps!r}")
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"GPTConfig.dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(
          f"GPTConfig.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
    if self.attention == "cudnn" and self.dtype == "float32":
      raise ValueError("GPTConfig: cuDNN attention needs dtype='bfloat16' or 'float16'; use"
                       " attention='xla' for float32")

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def d_mlp(self) -> int:
    return self.mlp_ratio * self.d_model if self.mlp_dim is None else self.mlp_dim

  @property
  def d_expert(self) -> int:
    return self.d_mlp if self.moe_mlp_dim is None else self.moe_mlp_dim

  @property
  def group_size(self) -> int:
    """Layers in each unit of the layer stack: ``moe_every`` when MoE layers alternate
    with dense ones (``models.gpt.Group``), else 1 (one ``Block`` per unit)."""
    return self.moe_every if self.num_experts else 1

  @property
  def padded_vocab(self) -> int:
    """The vocabulary rounded up to a multiple of 128 (which every power-of-two tp divides)."""
    return math.ceil(self.vocab_size / 128) * 128

  def num_params(self, embeddings: bool = True, active: bool = False) -> int:
    """Parameters of the model; without the embedding table when ``embeddings`` is False;
    with ``active``, only the experts a token uses (``moe_top_k`` of them)."""
    d, v, h = self.d_model, self.padded_vocab, self.head_dim
    attention = 2 * d * h * (self.num_heads + self.kv_heads)
    matrices = 3 if self.mlp == "swiglu" else 2
    mlp = matrices * d * self.d_mlp
    moe_layers = self.num_layers // self.moe_every if self.num_experts else 0
    experts = self.moe_top_k if active else self.num_experts
    moe_mlp = matrices * d * self.d_expert * (experts + self.moe_shared_expert) + d * self.num_experts
    qk_scales = 2 * h if self.qk_norm == "rms_scale" else 0
    layers = (self.num_layers * (attention + 2 * d + qk_scales) + (self.num_layers - moe_layers) * mlp
              + moe_layers * moe_mlp)
    head = 0 if self.tie_embeddings else d * v
    return layers + d + head + (d * v if embeddings or self.tie_embeddings else 0)

  def flops_per_token(self) -> float:
    """Training flops per token: 6·N (N the active parameters without the embedding
    lookup) + attention.

    Attention scores and their weighted sum cost 2·2·T·d multiply-adds per token and
    layer forward, times 3 with the backward pass: 12·L·T·d (the PaLM count, which
    counts the causal mask's zeros too).
    """
    attention = 12 * self.num_layers * self.seq_len * self.num_heads * self.head_dim
    return 6 * self.num_params(embeddings=False, active=True) + attention


PRESETS: dict[str, dict] = {
    # Trains visibly in a few minutes on 2 CPU cores.
    "tiny": dict(num_layers=4, d_model=128, num_heads=4, seq_len=128),
    # tiny with 8 experts of half its MLP width, 2 per token: tiny's active MLP parameters
    # (plus a router), four times as many in all.
    "tiny-moe": dict(num_layers=4, d_model=128, num_heads=4, seq_len=128, mlp_dim=256, num_experts=8,
                     moe_top_k=2),
    # microsoft/dion's GPT-small (GPT-2 124M shape with 6 heads of 128).
    "small": dict(num_layers=12, d_model=768, num_heads=6, seq_len=1024, vocab_size=50257),
    "350m": dict(num_layers=24, d_model=1024, num_heads=16, seq_len=1024, vocab_size=50257),
    "1b": dict(num_layers=24, d_model=2048, num_heads=16, seq_len=2048, vocab_size=50257),
}


def preset(name: str, **overrides) -> GPTConfig:
  """The preset ``name`` with ``overrides`` (fields of :class:`GPTConfig`) applied."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
  unknown = set(overrides) - {f.name for f in dataclasses.fields(GPTConfig)}
  if unknown:
    raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}; see models.GPTConfig")
  return GPTConfig(**{**PRESETS[name], **overrides})
