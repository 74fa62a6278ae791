"""The ``sampler`` stage of ``python -m train.gpu``: GRPO's rollout, the project's sampler
(``models.generate``, which ``train.grpo`` and ``train.sample`` call) decoding on ``small``
with random weights, beside transformers' ``generate`` on the same GPU.

Ours runs as GRPO's rollout does: the float32 weights a policy trains (the model keeps its
parameters float32) in bfloat16 compute, a batch of 64 prompts of 128 random tokens (every
row full, no padding), 256 new tokens each, drawn at temperature 1 with no top-k or top-p
(GRPO's defaults) and no end token, so that every row writes all 256. Transformers' is
``GPT2LMHeadModel`` of the same width, layers, heads, MLP width and vocabulary (GPT-2's
block: learned positions, LayerNorm, GELU; ours: rotary, RMSNorm, ReLU², QK-norm: the same
matmuls, a few elementwise ops apart), random, in bfloat16, with its key/value cache
(``use_cache=True``) and the same sampling (``do_sample=True``, temperature 1, ``top_k=0``,
``top_p=1``).

Each case's first call compiles (and warms up cuBLAS for torch); the second is timed:
tokens/s = batch x new tokens / its seconds, the prompts' prefill included (one pass over
128 tokens against 256 decode steps). Without transformers, torch or a CUDA device for
them, their row is one line (:data:`SKIP`).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import models
from models import generate

SKIP = "skipped: transformers/torch with CUDA not importable"


def _seconds(call) -> tuple[float, float]:
  """(first, second) call's wall time: compile and warm-up, then the timed one."""
  times = []
  for _ in range(2):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
  return times[0], times[1]


def _row(case: str, batch: int, new_tokens: int, first: float, second: float) -> dict:
  return {"case": case, "first_call_s": first, "seconds": second, "tokens_per_s": batch * new_tokens / second}


def ours(cfg: models.GPTConfig, prompts_BxP: np.ndarray, new_tokens: int) -> dict:
  """``models.generate`` on a random GPT of ``cfg``."""
  graphdef, params = models.init(cfg)
  params = dict(params, blocks=models.to_layers(params["blocks"], 1))
  lengths_B = np.full(len(prompts_BxP), prompts_BxP.shape[1], np.int32)

  def call():
    out = generate.generate(graphdef, params, prompts_BxP, lengths_B, jax.random.key(0), max_new_tokens=new_tokens,
                            sampling=generate.Sampling(temperature=1.0))
    assert int(jnp.min(out.lengths_B)) == new_tokens  # no end token: every row writes them all
    return out.tokens_BxM.block_until_ready()

  return _row(f"models.generate ({cfg.dtype} compute, float32 weights)", len(prompts_BxP), new_tokens, *_seconds(call))


def transformers_generate(cfg: models.GPTConfig, prompts_BxP: np.ndarray, new_tokens: int,
                          device: str | None = None) -> dict:
  """transformers' ``generate`` on a random ``GPT2LMHeadModel`` shaped as ``cfg``, in
  bfloat16 on ``device`` (default CUDA's); ``{"skipped": line}`` where it cannot run."""
  try:
    import torch
    import transformers
  except ImportError:
    return {"case": "transformers generate", "skipped": SKIP}
  device = device or ("cuda" if torch.cuda.is_available() else None)
  if device is None:
    return {"case": "transformers generate", "skipped": SKIP}
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=prompts_BxP.shape[1] + new_tokens,
                                   n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.d_mlp,
                                   bos_token_id=None, eos_token_id=None)
  model = transformers.GPT2LMHeadModel(config).to(device=device, dtype=torch.bfloat16).eval()
  prompts = torch.as_tensor(prompts_BxP, dtype=torch.long, device=device)
  wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def call():
    with torch.no_grad():
      out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                           use_cache=True)
    wait()
    assert out.shape[1] == prompts_BxP.shape[1] + new_tokens
    return out

  row = _row(f"transformers {transformers.__version__} generate (torch {torch.__version__}, bfloat16, {device})",
             len(prompts_BxP), new_tokens, *_seconds(call))
  model = None
  if device == "cuda":
    torch.cuda.empty_cache()  # back to the pool JAX's later stages share
  return row


def stage_sampler(args, preset: str = "small", batch: int = 64, prompt: int = 128, new_tokens: int = 256,
                  torch_device: str | None = None) -> dict:
  deadline = time.monotonic() + args.stage_seconds
  cfg = models.preset(preset, dtype="bfloat16")
  prompts_BxP = np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, prompt)).astype(np.int32)
  cases = [lambda: ours(cfg, prompts_BxP, new_tokens),
           lambda: transformers_generate(cfg, prompts_BxP, new_tokens, torch_device)]
  rows = []
  for case in cases:
    if time.monotonic() > deadline:
      break
    rows.append(case())
    print("  " + row_line(rows[-1]), flush=True)
  record = {"preset": preset, "batch": batch, "prompt": prompt, "new_tokens": new_tokens, "rows": rows,
            "complete": len(rows) == len(cases)}
  print(markdown(record), flush=True)
  return record


def row_line(row: dict) -> str:
  if "skipped" in row:
    return f"{row['case']}: {row['skipped']}"
  return (f"{row['case']}: {row['tokens_per_s']:,.0f} tokens/s ({row['seconds']:.2f} s;"
          f" first call {row['first_call_s']:.1f} s)")


def markdown(record: dict) -> str:
  lines = [f"{record['preset']}, random weights: {record['batch']} prompts of {record['prompt']} tokens,"
           f" {record['new_tokens']} new tokens each, temperature 1; the second call of each",
           "", "| case | seconds | new tokens/s | first call (compile), s |", "| --- | ---: | ---: | ---: |"]
  for row in record["rows"]:
    if "skipped" in row:
      lines.append(f"| {row['case']} | {row['skipped']} | | |")
    else:
      lines.append(f"| {row['case']} | {row['seconds']:.3f} | {row['tokens_per_s']:,.0f} | {row['first_call_s']:.1f} |")
  return "\n".join(lines)
