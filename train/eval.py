"""The loss of a model on data: ``python -m train.eval (RUN_DIR | hf:DIR) --data SPEC``.

Prints ``validation lm loss: X`` and the perplexity exp(X) of a run's checkpoint (the
latest, or ``--step``) or of a Hugging Face checkpoint directory, on one device. The number
is meant to be recomputable by anyone: the data's token streams, concatenated in order,
are cut to their first ``--tokens`` N tokens; window i holds tokens [i·T, i·T + T]
(T inputs, the targets shifted by one), for every i with i·T + T < N; the loss is the mean
over every target of every window, in float64 over float32 per-token losses.

Bad input prints one ``error: ...`` line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import data
import models
from train import cli, sample
from train import config as config_lib
from train import hf as hf_io
from train.cli import UsageError


def load_model(spec: str, step: int | None = None) -> tuple[models.GPTConfig, object, object]:
  """``(cfg, graphdef, params)`` on one device, blocks stacked as one stage, from a run
  directory or ``hf:DIR``."""
  if spec.startswith("hf:"):
    directory = os.path.abspath(spec[3:])
    if step is not None:
      raise UsageError("--step applies to run directories, not to hf:DIR")
    cfg = hf_io.model_config(directory, seq_len=1024)
    graphdef, params = hf_io.load(directory, cfg, models.Parallelism())
    return cfg, graphdef, params
  restored = sample.restore(os.path.abspath(spec), step)
  params = dict(restored.params, blocks=models.to_stages(restored.params["blocks"], 1))
  return restored.cfg, restored.graphdef, params


def windows(spec: str, num_tokens: int, seq_len: int) -> np.ndarray:
  """The windows [W, seq_len + 1] of the first ``num_tokens`` tokens of ``spec``'s streams."""
  source = data.load_source(config_lib.strip_format(spec), progress=False)
  parts = source.sources if isinstance(source, data.Blend) else (source,)
  if len(parts) > 1:
    raise UsageError(f"--data {spec}: a blend has no order of its tokens; pass one source")
  streams, need = [], num_tokens
  for s in parts[0].streams:
    streams.append(np.asarray(s[:need]))
    need -= len(streams[-1])
    if need <= 0:
      break
  tokens = np.concatenate(streams).astype(np.int64)
  count = (len(tokens) - 1) // seq_len
  if count < 1:
    raise UsageError(f"--data {spec}: {len(tokens)} tokens make no window of {seq_len + 1}"
                     " (--seq-len + 1); pass more --tokens or a shorter --seq-len")
  starts = np.arange(count)[:, None] * seq_len
  return tokens[starts + np.arange(seq_len + 1)]


def evaluate(cfg: models.GPTConfig, graphdef, params, windows_WxT1: np.ndarray,
             batch_size: int = 8) -> float:
  """Mean next-token loss over every target of ``windows_WxT1``."""
  @jax.jit
  def loss_sum(params, batch):
    return models.loss(graphdef, params, batch, denominator=jnp.float32(1))

  total, count = 0.0, 0
  for i in range(0, len(windows_WxT1), batch_size):
    w = windows_WxT1[i:i + batch_size]
    pad = batch_size - len(w)  # one compiled shape; padded rows count no target
    inputs = np.pad(w[:, :-1], ((0, pad), (0, 0)))
    targets = np.pad(w[:, 1:], ((0, pad), (0, 0)), constant_values=-1)
    total += float(loss_sum(params, {"inputs": jnp.asarray(inputs, jnp.int32),
                                     "targets": jnp.asarray(targets, jnp.int32)}))
    count += w[:, 1:].size
  return total / count


def _parser() -> argparse.ArgumentParser:
  parser = cli.Parser(prog="python -m train.eval",
                      description="Print the validation loss of a checkpoint on a data spec.")
  parser.add_argument("model", metavar="RUN_DIR|hf:DIR",
                      help="a python -m train.gpt run directory, or hf:DIR for a Hugging Face checkpoint")
  parser.add_argument("--data", required=True, metavar="SPEC",
                      help="data spec as train.gpt's --data (stdlib:val, fineweb:GLOB, megatron:PREFIX)")
  parser.add_argument("--tokens", type=int, default=16384, help="first N tokens of the data (default 16384)")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="tokens per window (default: the run's --seq-len; 1024 for hf:DIR)")
  parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step of RUN_DIR (default: the latest)")
  return parser


def _start(argv):
  args = _parser().parse_args(argv)
  for name in ("tokens", "seq_len", "batch_size"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  cfg, graphdef, params = load_model(args.model, args.step)
  w = windows(args.data, args.tokens, args.seq_len or cfg.seq_len)
  if w.max() >= cfg.vocab_size:
    raise UsageError(f"the data holds token {w.max()} but the model's vocabulary has"
                     f" {cfg.vocab_size}; evaluate on data made with the model's tokenizer")
  return cfg, graphdef, params, w, args.batch_size


def _report(loaded) -> int:
  cfg, graphdef, params, w, batch_size = loaded
  loss = evaluate(cfg, graphdef, params, w, batch_size)
  print(f"validation lm loss: {loss:.6E} | perplexity: {math.exp(min(loss, 700)):.6E} |"
        f" windows: {len(w)} x {w.shape[1] - 1} tokens")
  return 0


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: _start(argv), _report)


if __name__ == "__main__":
  sys.exit(main())
