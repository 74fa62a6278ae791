"""Decode speed on one CPU device: ``models.generate``'s key/value cache against the
fixed-window recompute ``train.sample`` used before it and transformers' cached ``generate``.

    python -m benchmarks.generate                          # batch 1 and 8, 64 new tokens
    python -m benchmarks.generate --batch 1 --new 32 --rounds 2

One random Llama-shaped model (GQA, SwiGLU, tied embeddings) is built in transformers,
saved, and imported with ``train.store.hf.load``, so that all three run the same weights. Each
case writes ``--new`` greedy tokens after a prompt of ``--prompt`` tokens (every row the
same length, no padding, no eos), the cases taking turns (``timing.interleaved_times``);
tokens/s is batch x new tokens over the whole call's median time, prefill included. The
old path handles one prompt at a time, so it runs at batch 1 only: it recomputes the
whole ``--window``-token context (the model's seq_len) for every token, as
``train.sample`` did (copied here as it was, greedy only). XLA and torch both run on one
thread (the machines here are shared).
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile

from benchmarks import harness
from train.gpu import timing

LLAMA = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=" ".join(__doc__.split("\n\n")[0].split()))
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--window", type=int, default=128, help="the old path's fixed context (seq_len)")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
  harness.setup_process(cpu_devices=1, platform="cpu")

  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  import models
  from models import generate
  from train import sample
  from train.store import hf as hf_io

  torch.set_num_threads(1)  # as XLA's single-threaded Eigen: the same one core for both
  torch.manual_seed(0)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
  hf_model.generation_config.eos_token_id = None
  directory = tempfile.mkdtemp()
  hf_model.save_pretrained(directory)
  cfg = hf_io.model_config(directory, seq_len=args.window)
  graphdef, params = hf_io.load(directory, cfg, models.Parallelism())
  params = dict(params, blocks=models.to_layers(params["blocks"], 1))

  @functools.partial(jax.jit, static_argnums=0)
  def old_next_token(graphdef, params, window_1xT, length):
    logits_V = sample.logits(graphdef, params, window_1xT)[0, length - 1]
    return jnp.argmax(jnp.where(jnp.arange(logits_V.shape[0]) < cfg.vocab_size, logits_V, -jnp.inf))

  def old_path(prompt_P):
    tokens = list(prompt_P)
    for _ in range(args.new):
      context = tokens[-args.window:]
      window_1xT = np.zeros((1, args.window), np.int32)
      window_1xT[0, :len(context)] = context
      tokens.append(int(old_next_token(graphdef, params, window_1xT, np.int32(len(context)))))
    return np.asarray(tokens[-args.new:])

  def cached(prompts_BxP):
    return generate.generate(graphdef, params, prompts_BxP, np.full(len(prompts_BxP), args.prompt, np.int32),
                             jax.random.key(0), max_new_tokens=args.new).tokens_BxM

  def transformers_generate(prompts_BxP):
    with torch.no_grad():
      return hf_model.generate(torch.as_tensor(prompts_BxP, dtype=torch.long), do_sample=False,
                               max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)

  rng = np.random.default_rng(0)
  print(f"model {LLAMA}; prompt {args.prompt}, {args.new} new tokens, greedy; {jax.devices()[0]},"
        f" torch threads {torch.get_num_threads()}")
  print("| batch | case | seconds | new tokens/s |")
  print("|---|---|---|---|")
  for batch in args.batch:
    prompts_BxP = rng.integers(1, LLAMA["vocab_size"], (batch, args.prompt)).astype(np.int32)
    ours = np.asarray(cached(prompts_BxP))
    theirs = transformers_generate(prompts_BxP)[:, args.prompt:].numpy()
    agree = float(np.mean(ours == theirs))
    cases = {"models.generate (cache)": (cached, (prompts_BxP,)),
             "transformers generate (cache)": (transformers_generate, (prompts_BxP,))}
    if batch == 1:
      cases["old train.sample (recompute)"] = (old_path, (prompts_BxP[0],))
    times = timing.interleaved_times(cases, rounds=args.rounds, repeats=1)
    for name, seconds in times.items():
      print(f"| {batch} | {name} | {seconds:.3f} | {batch * args.new / seconds:.0f} |")
    print(f"(batch {batch}: greedy tokens equal to transformers' at {agree:.1%} of places)")


if __name__ == "__main__":
  main()
