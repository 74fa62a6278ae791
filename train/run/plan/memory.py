"""What one training step holds per device, device and host memory apart, on paper: the
memory half of ``python -m train.plan``, checked against the compiled step's
``memory_analysis()`` (``train/run/compiled.py``) by ``tests/test_train_run_plan_memory.py``.

The step is ``train.run.setup.setup``'s as XLA schedules it on one device (b sequences of
T/cp tokens per micro-batch, a the compute dtype's bytes, L the layers of a pipeline stage):

- persistent (the step's donated arguments): the parameters' float32 shards, the optimizer
  state (in host memory with ``--offload-optimizer``);
- the gradients' float32 shards, held from the backward pass to the update (with
  micro-batches the running sum, which XLA updates in place, and beside it, when they are
  reduced over fs, the reduction's output, but in a pipeline, whose loop's backward pass
  sums them);
- the residuals the recompute policy keeps, per layer and micro-batch in flight
  (:func:`layer_tensors`, named as ``models/remat.py`` names them): the layer's input
  (float32 [b, T/cp, d], the scan's carry, always kept) and, where the policy keeps them,
  the query, key and value projections, the attention scores (float32 [b, N/tp, T/cp, T],
  XLA's attention), the attention's output, its out projection (a row-parallel product,
  whole d before the reduction over tp), the MLP's gate, up and down products; on the
  device or, offloaded, on the host;
- the loss, of b·(T/cp) tokens (in a pipeline M/pp micro-batches' at once, after it):
  unchunked, two vocabulary tables' worth (the LM head gathered and its gradient, the
  embedding's gradient) in float32, V·d/tp each, and three logits-sized buffers,
  tokens·V/tp each, the logits in the compute dtype (the head's product) and two float32
  (the logits cast, their softmax and gradient); chunked (``--loss-chunk``), the larger of
  four tables (the embedding's lookup gathers one before the chunks' scans) and three
  tables (the head gathered, both gradients, zeros from the step's start) beside two
  float32 logits-sized buffers of one chunk's tokens, forward and backward alike;
- with micro-batches over fs outside a pipeline, the embedding and the LM head gathered
  through the whole loop (XLA hoists their gathers out of it), and below float32 one more
  float32 table;
- the backward pass of one layer: its kernels gathered (the forward's, for the
  recomputation, and the backward's) in float32, the causal mask XLA materializes
  (float32 and bool, scores-sized), three scores-sized float32 buffers (probabilities,
  their gradient, the scores' gradient), six float32 [b, T/cp, d] cotangents, the dense
  MLP's float32 [b, T/cp, F/tp] activation and gradients (two for relu2, four for swiglu),
  on tp the row-parallel products' whole-d partial sums and reductions (two [b, T/cp, d]),
  and the products ``none`` keeps that the policy recomputes;
- in a pipeline, its loop's copies of the residuals' stacks: the layers' inputs whole, of
  the other kept tensors :data:`PIPELINE_COPIES` (measured: the copies needed for a plan
  of 1.0 were 1.15-1.42 of those stacks on tiny, pp=2 and 4, under ``none`` and
  ``selective``, with micro-batches and without, relu2 and swiglu; which XLA copies was
  not traced).

The step's temporaries are the gradients, the residuals, the update's and the larger of
the two transients (the loss's, one layer's backward pass). XLA packs its buffers into one
temporary allocation above the peak of the live ones (buffers of different lifetimes do
not tile: ``tiny`` at T = 256 holds 14.0 MB live at its peak in an allocation of 16.8 MB),
which the planner counts as :data:`PACKING` of the temporaries. On the cases
``benchmarks/plan_memory.py`` compiles, planned / compiled is between 1.0 and 1.25
(``docs/planning.md`` gives each).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

import models
from models import remat
from train.run.plan import optimizer as plan_optimizer
from train.run.plan.model import Leaf, Step, local_bytes

PACKING = 0.12  # XLA's temporary allocation over its live peak (module docstring)
# A pipeline's loop copies its residuals' stacks: the layers' inputs whole, of the others this
# part (module docstring).
PIPELINE_COPIES = 0.6


def placements(policy: str, devices: int = 1) -> dict[str, str]:
  """What ``policy`` keeps and where (``models.remat.placements``), with the attention's
  scores, which ``none`` keeps besides its named products. On a mesh (``devices`` > 1) the
  experts' dispatch keeps only its input and weights under every policy (``models/moe.py``)."""
  kept = remat.placements(policy)
  if policy == "none":
    kept["scores"] = "device"
  if devices > 1:
    kept = {name: place for name, place in kept.items() if not name.startswith("expert_")}
  return kept


def layer_tensors(cfg: models.GPTConfig, sizes: dict[str, int], micro: int) -> dict[str, int]:
  """Bytes per device of each of a layer's named tensors, one micro-batch of ``micro``
  sequences (an MoE layer's expert products for its tokens' top-k assignments)."""
  tp, a = sizes["tp"], jnp.dtype(cfg.dtype).itemsize
  tokens = micro * cfg.seq_len // sizes["cp"]
  heads, kv = cfg.num_heads // tp * cfg.head_dim, cfg.kv_heads // tp * cfg.head_dim
  out = {"layer_input": tokens * cfg.d_model * 4, "query_proj": tokens * heads * a, "key_proj": tokens * kv * a,
         "value_proj": tokens * kv * a, "attention_out": tokens * heads * a, "out_proj": tokens * cfg.d_model * a,
         "scores": 0 if cfg.attention == "cudnn" else tokens * cfg.num_heads // tp * cfg.seq_len * 4}
  dense = cfg.d_mlp // tp
  out |= {"mlp_up": tokens * dense * a, "mlp_down": tokens * cfg.d_model * a,
          "mlp_gate": tokens * dense * a if cfg.mlp == "swiglu" else 0}
  if cfg.num_experts:
    rows = tokens * cfg.moe_top_k * sizes["ep"]  # the tokens of the ep group, routed here, dropless
    expert = cfg.d_expert // tp
    out |= {"expert_up": rows * expert * a, "expert_down": rows * cfg.d_model * a,
            "expert_gate": rows * expert * a if cfg.mlp == "swiglu" else 0}
  return out


def _layer_kernels(params: Sequence[Leaf], sizes: dict[str, int]) -> int:
  """One layer's kernels as the layer uses them: whole but for tp (experts: their ep
  shard), float32."""
  total = 0
  for leaf in params:
    if leaf.name.startswith("['blocks']"):
      gathered = {**sizes, "rp": 1, "fs": 1, "cp": 1, "pp": 1, **({} if "experts" in leaf.name else {"ep": 1})}
      total += local_bytes(leaf, gathered) // (leaf.shape[0] * leaf.shape[1])
  return total


def memory(cfg: models.GPTConfig, sizes: dict[str, int], step: Step, params: Sequence[Leaf], state_bytes: int,
           policy: str = "none", offload_optimizer: bool = False, loss_chunk: int = 0, optimizer: str = "adamw",
           rank_fraction: float = 0.25, split_q: bool = False, megabatch_bytes: int | None = None) -> dict:
  """The step's memory per device (module docstring): ``{"device": {part: bytes},
  "host": {part: bytes}, "device_total", "host_total", "residuals": {name: bytes per
  layer}}``; ``loss_chunk`` tokens per chunk of the loss (0: unchunked); ``rank_fraction``
  and ``split_q`` Dion's; ``megabatch_bytes`` the update's chunks (``--megabatch-mib``)."""
  kept = placements(policy, math.prod(sizes.values()))
  per_layer = layer_tensors(cfg, sizes, step.micro)
  layers = cfg.num_layers // sizes["pp"]
  # A pipeline differentiates its whole loop: every iteration's residuals wait for the backward pass.
  in_flight = step.accum + sizes["pp"] - 1 if sizes["pp"] > 1 else 1
  residuals, copied = {"device": 0, "host": 0}, 0
  for name, nbytes in per_layer.items():
    if name in kept:
      residuals[kept[name]] += layers * in_flight * nbytes
      if kept[name] == "device" and sizes["pp"] > 1:
        copied += layers * in_flight * nbytes * (1 if name == "layer_input" else PIPELINE_COPIES)
  p_bytes = sum(local_bytes(leaf, sizes) for leaf in params)
  tp, tokens = sizes["tp"], step.micro * cfg.seq_len // sizes["cp"]
  if sizes["pp"] > 1:
    # After a pipeline each stage takes the loss of M/pp micro-batches at once
    # (``models.pipeline.scatter_from_last``; tiny on fs=2,tp=2,pp=2, 4 micro-batches of 2
    # sequences: 0.766 of the compiled step with one micro-batch's tokens).
    tokens *= step.accum // sizes["pp"]
  if loss_chunk:
    tokens = min(tokens, loss_chunk)
  table, logits = cfg.padded_vocab * cfg.d_model // tp * 4, tokens * cfg.padded_vocab // tp * 4
  t = step.micro * cfg.seq_len // sizes["cp"]
  scores = 0 if cfg.attention == "cudnn" else t * cfg.num_heads // tp * cfg.seq_len
  backward = 2 * _layer_kernels(params, sizes) + (5 + 3 * 4) * scores + 6 * t * cfg.d_model * 4
  if not cfg.num_experts or cfg.moe_every > 1:
    # The dense MLP's backward pass, float32 [b, T/cp, F/tp] each: relu2's activation and
    # its gradient beside the kept products; swiglu's also the gate's and up's gradients.
    backward += (4 if cfg.mlp == "swiglu" else 2) * t * (cfg.d_mlp // tp) * 4
  if tp > 1:
    # The row-parallel products' (out projection's, MLP down's) whole-d partial sums and
    # their reductions over tp, float32 [b, T/cp, d].
    backward += 2 * t * cfg.d_model * 4
  if cfg.num_experts:
    # Each local expert's dropless buffer of every assignment its ep group routes ([E/ep, R, d]):
    # about 3.5 float32 and a mask of them, and 2.5 of the experts' hidden width.
    rows, local = t * cfg.moe_top_k * sizes["ep"], cfg.num_experts // sizes["ep"]
    backward += local * rows * (15 * cfg.d_model + 10 * cfg.d_expert // tp)
  # The backward pass of a layer recomputes what the policy dropped of ``none``'s products.
  backward += sum(b for n, b in per_layer.items() if n in placements("none", math.prod(sizes.values()))
                  and n not in kept)
  if loss_chunk:
    # Chunked, the loss's scans hold the gathered head and both tables' gradients (zeros
    # from the step's start) throughout, beside a chunk's logits and one more logits-sized
    # buffer, forward and backward; before them the embedding's lookup gathers a fourth
    # table (XLA's live ranges: tiny, fs=8, chunks of 128 tokens; four tables and three
    # logits-sized buffers at once were 1.519 of the compiled step there).
    loss = max(4 * table, 3 * table + 2 * logits)
  else:
    # The logits in the compute dtype (the head's product) and two float32 buffers of them
    # (three float32 were 1.279 of the compiled step in bfloat16: tiny, fs=4,tp=2).
    loss = 2 * table + logits * (8 + jnp.dtype(cfg.dtype).itemsize) // 4
  transients = {"loss": loss, "layer_backward": backward}
  if step.accum > 1 and sizes["fs"] > 1 and sizes["pp"] == 1:
    # XLA hoists the embedding's and the LM head's gathers over fs out of the micro-batch
    # loop: both tables stay gathered through every layer's backward pass, and the loss
    # holds the embedding's beside its own (measured: tiny fs=4,tp=2 AdamW, micro-batches
    # of one sequence, 0.952 without them).
    gathered = (1 if cfg.tie_embeddings else 2) * table
    if jnp.dtype(cfg.dtype).itemsize < 4:
      # Below float32 XLA holds one more float32 table through the loop (tiny fs=4,tp=2,
      # micro-batches of one sequence, GPT-2's vocabulary: the bfloat16 step 12.3 MiB, V·d/tp,
      # above the float32 one; 0.972 without it).
      gathered += table
    transients = {"loss": transients["loss"] + gathered - table, "layer_backward": backward + gathered}
  temporaries = {
      # Micro-batches reduced over fs outside a pipeline: the running sum and the reduction's
      # output (measured: rp=2,fs=2,tp=2 and fs=8 hold both; rp=8 adds in place).
      "gradients": p_bytes * (2 if step.accum > 1 and sizes["pp"] == 1 and sizes["fs"] > 1 else 1),
      "residuals": residuals["device"] + int(copied),
      "update": plan_optimizer.update_memory(params, sizes, optimizer, rank_fraction, split_q, megabatch_bytes),
      # A pipeline's loop state: every micro-batch's embedded input and stage output, and
      # their cotangents, float32 [b, T/cp, d] each.
      "pipeline": 4 * step.accum * per_layer["layer_input"] if sizes["pp"] > 1 else 0,
      "transient": max(transients.values()),
  }
  device = {"parameters": p_bytes, "optimizer_state": 0 if offload_optimizer else state_bytes, **temporaries,
            "packing": int(PACKING * sum(temporaries.values()))}
  host = {"optimizer_state": state_bytes if offload_optimizer else 0, "residuals": residuals["host"]}
  return {"device": device, "host": host, "device_total": sum(device.values()), "host_total": sum(host.values()),
          "transients": transients, "policy": policy, "offload_optimizer": offload_optimizer,
          "loss_chunk": loss_chunk, "residuals_per_layer": {n: b for n, b in per_layer.items() if n in kept and b}}


def recompute_flops(cfg: models.GPTConfig, policy: str) -> float:
  """Flops per token the policy's recomputation adds to a step: the forward products it
  does not keep, once more (``full``: a whole forward pass of the layers, 2·N + the
  attention's 4·L·T·d, but for the MLP's down projection, whose output the backward pass
  never reads; elementwise work left out)."""
  kept = placements(policy)
  d, heads, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
  mlp = cfg.d_expert * cfg.moe_top_k if cfg.num_experts else cfg.d_mlp
  flops = {"query_proj": 2 * d * heads, "key_proj": 2 * d * kv, "value_proj": 2 * d * kv,
           "scores": 2 * cfg.seq_len * heads, "attention_out": 2 * cfg.seq_len * heads, "out_proj": 2 * heads * d,
           "mlp_up": 2 * d * mlp, "mlp_gate": 2 * d * mlp if cfg.mlp == "swiglu" else 0}
  if cfg.num_experts:  # the experts' products carry the expert_* names
    flops |= {f"expert_{k}": flops.pop(f"mlp_{k}") for k in ("up", "gate")}
  return cfg.num_layers * sum(f for name, f in flops.items() if name not in kept)
