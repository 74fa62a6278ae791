"""What a trained GPT writes: ``python -m train.sample RUN_DIR --prompt "def " [...]``.

Restores the parameters of the run's latest (or ``--step``) checkpoint onto one device,
rebuilds the GPT from that checkpoint's config record, and continues the prompt (byte
tokens, or the ``tokenizer.json`` of the checkpoint a ``--init-from hf:DIR`` run started
from) with ``models.generate``'s key/value cache: the prompt's last ``seq_len`` tokens (the
length the model was trained on) are run once, then one token per step. Greedy with
``--temperature 0`` (the default), else drawn from softmax(logits / temperature), optionally
among the ``--top-k`` likeliest tokens and the likeliest ones whose probability reaches
``--top-p`` (which sampling needs: with ``--temperature 0`` they are refused). An empty
prompt starts a document: its context is the end-of-document token. ``--prompt`` repeated
continues each prompt in turn.

With ``--chat`` the prompt is a user message: the conversation ``[{"role": "user",
"content": PROMPT}]`` rendered by the tokenizer's chat template with the generation prompt
(``data.chat``), and only the reply is printed, up to its end-of-sequence token, where
the generation stops.

It says on stderr what it writes before it compiles the sampler. Bad input (a missing run,
checkpoint or step, a bad flag) prints one ``error: ...`` line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import data
import models
from data import hf_tokenizer
from models import generate as model_generate
from models import gpt
from train import cli
from train.cli import UsageError
from train.run import preflight
from train.run import restore as restore_lib


def logits(graphdef: Any, params: Any, tokens_BxT: jax.Array) -> jax.Array:
  """Next-token logits at every position, float32 [B, T, padded vocab], on one device.

  ``models.loss`` only ever forms the loss (its logits stay vocab-parallel), so the
  model's final norm and LM head (``GPT.logits``) are applied here to the layers' output.
  """
  par = models.Parallelism()
  model = nnx.merge(graphdef, params)
  rope = gpt.rotary_tables(model.cfg, jnp.arange(tokens_BxT.shape[1]))
  x_BxTxD = model.embed_tokens(tokens_BxT, par)
  x_BxTxD, _ = gpt.apply_layers(nnx.graphdef(model.blocks), params["blocks"], x_BxTxD, rope, par, model.cfg)
  return model.logits(x_BxTxD, par)


def continuation(model: restore_lib.Restored, prompt_P: np.ndarray, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, eod: int = data.EOD, top_p: float = 1.0,
                 eos_id: int | None = None) -> Iterator[np.ndarray]:
  """The tokens that follow ``prompt_P`` (int [P]; its last ``seq_len`` tokens), written by
  ``models.generate.stream`` with its key/value cache, int32 chunks as they come:
  ``max_new_tokens`` in all, or up to and with the first ``eos_id``. An empty prompt
  starts from the end-of-document token ``eod``."""
  prompt_P = np.asarray(prompt_P, np.int32)[-model.cfg.seq_len:]
  if not len(prompt_P):
    prompt_P = np.asarray([eod], np.int32)
  sampling = model_generate.Sampling(float(temperature), top_k, float(top_p))
  return model_generate.stream(model.graphdef, model.params, prompt_P, max_new_tokens, sampling, seed, eos_id)


def generate(model: restore_lib.Restored, prompt_P: np.ndarray, max_new_tokens: int, **kwargs) -> np.ndarray:
  """:func:`continuation`'s tokens, all of them: int32 [<= max_new_tokens]."""
  return np.concatenate([np.zeros(0, np.int32), *continuation(model, prompt_P, max_new_tokens, **kwargs)])


def _parser() -> argparse.ArgumentParser:
  parser = cli.Parser(prog="python -m train.sample",
                      description="Print what a trained GPT writes after a prompt (byte tokens, or the"
                                  " tokenizer.json of the run's --init-from checkpoint).")
  parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of python -m train.gpt")
  parser.add_argument("--prompt", action="append", default=None,
                      help="text to continue (default: the start of a document); repeat it for several"
                           " prompts, each continued and printed in turn after a [prompt i/N] line")
  parser.add_argument("--chat", action="store_true",
                      help="the prompt is a user message, rendered by the run tokenizer's chat"
                           " template; print the assistant's reply up to its end-of-sequence token")
  parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to write (default 200)")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="0 for greedy decoding (default), > 0 to sample from softmax(logits / T)")
  parser.add_argument("--top-k", type=int, default=None,
                      help="sample among the K likeliest tokens only (with --temperature > 0)")
  parser.add_argument("--top-p", type=float, default=1.0,
                      help="sample among the likeliest tokens whose probability reaches P only, in"
                           " (0, 1] (with --temperature > 0; default 1: all)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  return parser


def _restore(argv: list[str] | None) -> tuple[argparse.Namespace, restore_lib.Restored, Any, list[np.ndarray]]:
  """The flags, the restored model, its tokenizer and the prompts' tokens; bad input raises
  here, before any generation."""
  args = _parser().parse_args(argv)
  if args.max_new_tokens < 1:
    raise UsageError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
  restore_lib.check_sampling(args.temperature, args.top_k, args.top_p)
  if args.temperature == 0 and (args.top_k is not None or args.top_p < 1):
    chosen = " ".join(f for f, on in ((f"--top-k {args.top_k}", args.top_k is not None),
                                      (f"--top-p {args.top_p}", args.top_p < 1)) if on)
    raise UsageError(f"{chosen} applies when sampling, but --temperature is 0 (the default: greedy);"
                     " add a --temperature above 0, e.g. --temperature 0.8")
  args.prompt = args.prompt or [""]
  run_dir = os.path.abspath(args.run_dir)
  model = restore_lib.restore(run_dir, args.step)
  tokenizer = restore_lib.run_tokenizer(run_dir)
  if tokenizer.vocab_size > model.cfg.vocab_size or (
      isinstance(tokenizer, hf_tokenizer.ByteTokenizer) and model.cfg.vocab_size != data.VOCAB_SIZE):
    raise UsageError(f"the run's vocabulary has {model.cfg.vocab_size} tokens and no tokenizer of"
                     f" its own: train.sample reads and writes bytes ({data.VOCAB_SIZE} tokens) or"
                     " uses the tokenizer.json of the run's --init-from checkpoint")
  if args.chat and tokenizer.chat is None:
    raise UsageError("--chat needs a chat template: " + (
        "this run reads bytes (it started from no --init-from hf: checkpoint with a tokenizer)"
        if isinstance(tokenizer, hf_tokenizer.ByteTokenizer) else
        "the run's --init-from checkpoint has no chat_template.jinja nor chat_template in tokenizer_config.json"))
  prompts = [_encode(args, tokenizer, prompt) for prompt in args.prompt]
  _check_cache(model.cfg, max(len(p) for p in prompts), args.max_new_tokens)
  return args, model, tokenizer, prompts


def _encode(args: argparse.Namespace, tokenizer, prompt: str) -> np.ndarray:
  """The prompt's tokens (with ``--chat``, its user message rendered by the chat template)."""
  if args.chat:
    text = tokenizer.chat.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, special=False)  # the template writes the special tokens
  return tokenizer.encode(prompt) if prompt else np.zeros(0, np.int32)


def _check_cache(cfg: models.GPTConfig, prompt_tokens: int, max_new_tokens: int) -> None:
  """Refuses a key/value cache (the prompt's bucket + the new tokens, a slot each) that
  one device cannot hold, naming the --max-new-tokens that fits."""
  capacity = preflight.device_capacity([jax.devices()[0]])
  if capacity is None:
    return
  limit, _, where = capacity
  prompt_slots = model_generate.bucket(min(max(prompt_tokens, 1), cfg.seq_len))
  slot = model_generate.cache_bytes(cfg, 1, 1)
  if slot * (prompt_slots + max_new_tokens) > limit:
    fits = limit // slot - prompt_slots
    raise UsageError(f"--max-new-tokens {max_new_tokens:,} needs a key/value cache of"
                     f" {slot * (prompt_slots + max_new_tokens) / 2**30:,.1f} GiB, more than {where};"
                     f" at most {fits:,} new tokens fit" + (
                         f" (the model was trained on {cfg.seq_len:,} positions)" if fits > cfg.seq_len else ""))


def _write(args: argparse.Namespace, model: restore_lib.Restored, tokenizer, prompts: list[np.ndarray]) -> int:
  n = len(prompts)
  print(f"writing up to {args.max_new_tokens} tokens after {n} prompt{'s' if n > 1 else ''} (compiling the"
        " sampler first)", file=sys.stderr, flush=True)
  for i, prompt_P in enumerate(prompts):
    if n > 1:
      print(f"[prompt {i + 1}/{n}]")
    _continue(args, model, tokenizer, prompt_P)
  return 0


def _continue(args: argparse.Namespace, model: restore_lib.Restored, tokenizer, prompt_P: np.ndarray) -> None:
  """Prints what the model writes after the prompt's tokens as it writes them (with
  ``--chat`` only the reply, up to its end-of-sequence token)."""
  shown = _Shown(tokenizer, np.zeros(0, np.int32) if args.chat else prompt_P.astype(np.int32))
  for chunk in continuation(model, prompt_P, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                            tokenizer.eod, args.top_p, eos_id=tokenizer.eod if args.chat else None):
    ends = np.flatnonzero(chunk == tokenizer.eod) if args.chat else ()
    shown.add(chunk[:ends[0]] if len(ends) else chunk)
    if len(ends):
      break
  shown.end()


class _Shown:
  """Text printed as its tokens come: each time, what the decoded whole adds to what is
  printed, less a trailing incomplete character (a byte of a UTF-8 sequence, decoded as
  U+FFFD until the rest comes). So the text printed is the whole's decoding."""

  def __init__(self, tokenizer, tokens: np.ndarray):
    self.tokenizer, self.tokens, self.printed = tokenizer, np.zeros(0, np.int32), ""
    self.add(tokens)

  def add(self, tokens: np.ndarray, last: bool = False) -> None:
    self.tokens = np.concatenate([self.tokens, tokens])
    text = self.tokenizer.decode(self.tokens)
    ready = text if last else text.rstrip("\ufffd")
    if ready.startswith(self.printed):  # a tokenizer whose decoding of more rewrites the end waits
      print(ready[len(self.printed):], end="", flush=True)
      self.printed = ready

  def end(self) -> None:
    self.add(np.zeros(0, np.int32), last=True)
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: _restore(argv), lambda restored: _write(*restored),
                 interrupted="interrupted; train.sample writes no files", read_only=True)


if __name__ == "__main__":
  cli.exit(main())
