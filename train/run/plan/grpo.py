"""GRPO's step on paper (``python -m train.plan --grpo``): the rollout's memory and time
beside the update's, per device.

A GRPO step (``train/grpo/rollout.py``) samples ``group`` completions of up to ``completion``
tokens for each of ``prompts`` prompts left-padded to ``prompt`` tokens
(``models/generate.py``), scores them, and runs the trainer's step on the B = prompts·group
sequences of S = prompt + completion tokens (the update: ``train.run.plan.memory`` with that
batch and length). While it samples, the device holds besides the training state
(parameters and optimizer state, as between steps):

- the rollout's weights: every parameter gathered over the mesh but for tp
  (``generate.rollout_params``), float32, whole/tp;
- the key/value cache: keys and values [L, B/dp, S, K/tp, H] in the compute dtype, B/dp
  the sequences of a data-parallel rank (the prompts split over rp, fs and ep; cp and pp
  ranks sample the same rows), twice (the decode loop's carry and its update);
- the prefill's transient: one layer's float32 scores [B/dp, N/tp, P, S] (three), two
  [B/dp, P, d] and one [B/dp, P, F/tp] float32 activations, the logits; and XLA's packing
  (``train.run.plan.memory.PACKING`` of these temporaries);
- with ``beta`` > 0 the reference policy (the starting parameters, laid out as the
  policy's: its float32 shards), held for the whole run.

Time: the prefill at the planner's MFU (2·N flops per prompt token and the attention's), then
``completion`` decode steps, each the longer of its flops (2·N per sequence) at that MFU and
its reads of the rollout's weights and the cache at the GPU's memory bandwidth (a decode
step is bandwidth-bound).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp

import models
from train.run.plan.memory import PACKING
from train.run.plan.model import Leaf, local_bytes

# GRPO's update beside train.gpt's step: its batch's per-token fields past inputs and
# targets (old log-probabilities, advantages, masks, weights, positions, segment ids: 9),
# int32 or float32, all the rank's rows; and its objective's per-token float32 terms and
# their gradients, one micro-batch's, counted generously (measured: tiny, 8 prompts x 4,
# 32-token rows, fs=8, fs=4,tp=2, rp=2,fs=2,tp=2, AdamW and Dion: the compiled update 15-36
# KB above train.gpt's step of the same shape, 30-36 [b, T] float32 buffers).
UPDATE_FIELDS, OBJECTIVE_TERMS = 9, 40


class GRPO(NamedTuple):
  """A GRPO step's shape: ``train.grpo``'s --prompts-per-step, --group-size,
  --max-new-tokens and --beta (their defaults), and the prompts' padded length."""
  prompts: int = 8
  group: int = 8
  prompt: int = 256
  completion: int = 64
  beta: float = 0.0

  @property
  def sequences(self) -> int:
    return self.prompts * self.group

  @property
  def length(self) -> int:
    return self.prompt + self.completion


def rollout_weights(params: Sequence[Leaf], sizes: dict[str, int]) -> int:
  """The parameters gathered but for tp, float32, per device."""
  return sum(local_bytes(leaf, {a: (n if a == "tp" else 1) for a, n in sizes.items()}) for leaf in params)


def rollout(cfg: models.GPTConfig, sizes: dict[str, int], params: Sequence[Leaf], g: GRPO, resident: int,
            peak_flops: float, mfu: float, hbm_bandwidth: float) -> dict:
  """The rollout's memory per device (``device``: parts; ``resident``: the training state
  and reference it samples beside) and its seconds."""
  dp = sizes["rp"] * sizes["fs"] * sizes["ep"]  # models.BATCH_AXES: cp and pp ranks sample the same rows
  local = math.ceil(g.sequences / dp)
  tp, a = sizes["tp"], jnp.dtype(cfg.dtype).itemsize
  weights = rollout_weights(params, sizes)
  cache = 2 * cfg.num_layers * local * g.length * (cfg.kv_heads // tp) * cfg.head_dim * a
  tokens = local * g.prompt
  scores = tokens * cfg.num_heads // tp * g.length * 4
  prefill = 3 * scores + tokens * (2 * cfg.d_model + cfg.d_mlp // tp) * 4 + 3 * local * cfg.padded_vocab // tp * 4
  # The decode loop carries the cache and writes its update beside it: two copies.
  temporaries = {"cache": 2 * cache, "prefill": prefill}
  device = {"training_state": resident, "weights": weights, **temporaries,
            "packing": int(PACKING * sum(temporaries.values()))}
  active = cfg.num_params(embeddings=False, active=True)
  # Each device runs its rank's sequences, tp splitting the work (cp and pp ranks repeat it).
  prefill = (2 * active + 4 * cfg.num_layers * g.prompt * cfg.num_heads * cfg.head_dim) * local * g.prompt / tp
  prefill_s = prefill / (peak_flops * mfu)
  per_token_flops = 2 * active * local / tp
  per_token_bytes = weights + cache / 2  # on average half the cache's slots are filled
  decode_s = g.completion * max(per_token_flops / (peak_flops * mfu), per_token_bytes / hbm_bandwidth)
  return {"device": device, "device_total": sum(device.values()), "seconds": prefill_s + decode_s,
          "prefill_seconds": prefill_s, "decode_seconds": decode_s, "sequences_per_device": local}
