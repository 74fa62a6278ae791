"""``python -m train.plan``: the planner's command line (the planner: ``train/run/plan/planner.py``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax

from dion_jax.parallel.mesh import AXES
from train import cli
from train.run.plan import optimizer as plan_optimizer
from train.run.plan.grpo import GRPO
from train.run.plan import planner
from train.run.plan.planner import GPUS, LINKS, TRAINER, Link, format_plan, format_sweep, plan, sweep
from train.run.config import megabatch_bytes
from train.run.optim import RANK_BY_WIDTH


def _links(text: str) -> dict[str, str]:
  out = {}
  for item in filter(None, text.split(",")):
    axis, _, kind = item.partition("=")
    if axis not in AXES or kind not in LINKS:
      raise ValueError(f"--links {text}: expected axis=nvlink|ib items, axes from {', '.join(AXES)}")
    out[axis] = kind
  return out


def _link(flag: str, text: str) -> Link:
  try:
    gbps, us = (float(x) for x in text.split(":"))
  except ValueError:
    gbps = us = -1.0
  if not (gbps > 0 and us >= 0):
    raise ValueError(f"{flag} {text}: expected GBPS:MICROSECONDS, e.g. {flag} 400:8")
  return Link(gbps * 1e9, us * 1e-6)


def _check(args: argparse.Namespace) -> None:
  """Refuses counts and fractions no step has (None: the flag's default)."""
  positive = ("global_batch_size", "micro_batch_size", "seq_len", "gpus_per_node", "prompts_per_step", "group_size",
              "prompt_len", "max_new_tokens")
  for name in positive:
    value = getattr(args, name)
    if value is not None and value < 1:
      raise cli.UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
  if args.loss_chunk < 0:
    raise cli.UsageError(f"--loss-chunk must be 0 (unchunked) or positive, got {args.loss_chunk}")
  for name in ("rank_fraction", "fraction", "mfu"):
    value = getattr(args, name)
    if value is not None and not 0 < value <= 1:
      raise cli.UsageError(f"--{name.replace('_', '-')} must be in (0, 1], got {value:g}")
  if args.beta < 0:
    raise cli.UsageError(f"--beta must be 0 or positive, got {args.beta:g}")
  if not args.megabatch_mib >= 0 or args.megabatch_mib == float("inf"):
    raise cli.UsageError(f"--megabatch-mib must be 0 (off) or a positive number of MiB, got {args.megabatch_mib:g}")


def main(argv: list[str] | None = None) -> int:
  parser = cli.Parser(prog="python -m train.plan", description=planner.__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
  # train.gpt's names (--preset, --dion-rank-fraction) are taken too: its memory error sends its flags here.
  parser.add_argument("--model", "--preset", default="small",
                      help="small|350m|1b|8b|70b|405b|tiny|tiny-moe, hf:DIR, hf:ORG/NAME[@REVISION] (its config.json"
                           " only) or CONFIG.json (default small; also --preset, python -m train.gpt's name)")
  parser.add_argument("--mesh", default="fs=8", help="rp=..,fs=..,ep=..,cp=..,tp=..,pp=.. (default fs=8)")
  parser.add_argument("--optimizer", default=TRAINER.optimizer, choices=plan_optimizer.OPTIMIZERS,
                      help=f"the step's optimizer (default {TRAINER.optimizer}, as python -m train.gpt)")
  parser.add_argument("--rank-fraction", "--dion-rank-fraction", type=float, default=None,
                      help="Dion's rank fraction (also --dion-rank-fraction, python -m train.gpt's name; default:"
                           " train.gpt's for the model's width,"
                           + ", ".join(f" {f:g} from {w}" for w, f in RANK_BY_WIDTH) + ")")
  parser.add_argument("--megabatch-mib", type=float, default=0.0,
                      help="the matrix optimizers' update stepped in chunks of at most this many MiB of"
                           " gradients and state per device, one after another (python -m train.gpt"
                           " --megabatch-mib; default 0, off; with --sweep: always, where without it the"
                           " sweep tries off and 1)")
  parser.add_argument("--dion-split-q", action="store_true",
                      help="Dion's Q split over the row axes (tp) too, an all-gather of it per step"
                           " (python -m train.gpt --dion-split-q; with --sweep: always, where without"
                           " it the sweep tries both)")
  parser.add_argument("--fraction", type=float, default=0.25,
                      help="Dion2/NorDion2's selected fraction (default 0.25, as python -m train.gpt)")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                      help="activations' dtype (default bfloat16, python -m train.gpt's on a GPU; float32 is"
                           " its CPU default, to compare with a CPU run)")
  parser.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: one per rank)")
  parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank and micro-batch (default: all of a rank's, one micro-batch, as python -m train.gpt)")
  parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's; for hf:DIR min(max_position_embeddings,"
                           " 1024), as python -m train.gpt)")
  parser.add_argument("--gpu", default="h100", choices=tuple(GPUS),
                      help="the GPU whose memory, bf16 flops, memory bandwidth and host link the plan assumes"
                           " (default %(default)s; NVLink and InfiniBand: --nvlink, --ib)")
  parser.add_argument("--gpus-per-node", type=int, default=8,
                      help="GPUs a node's NVLink joins: axes within a node take NVLink, across nodes InfiniBand"
                           " (default %(default)s)")
  parser.add_argument("--links", default="", help="per-axis link overrides, e.g. tp=nvlink,fs=ib")
  parser.add_argument("--nvlink", default="450:5", help="NVLink GB/s per device and direction : µs per step")
  parser.add_argument("--ib", default="50:10", help="InfiniBand/RoCE GB/s per device and direction : µs per step")
  parser.add_argument("--mfu", type=float, default=0.5, help="fraction of peak flops the compute reaches (default 0.5)")
  parser.add_argument("--remat", nargs="?", const="full", default=None, metavar="POLICY",
                      help="the trainer's recompute policy (python -m train.gpt --remat; alone: full; default none;"
                           " with --sweep: every policy)")
  parser.add_argument("--offload-optimizer", action="store_true",
                      help="the optimizer state in host memory between steps (python -m train.gpt --offload-optimizer)")
  parser.add_argument("--loss-chunk", type=int, default=0,
                      help="tokens per chunk of the LM head and loss (python -m train.gpt --loss-chunk; default 0: unchunked)")
  grpo = parser.add_argument_group("GRPO (--grpo: python -m train.grpo's step, its rollout and update)")
  grpo.add_argument("--grpo", action="store_true", help="plan a GRPO step: the rollout's memory and time, then the update")
  grpo.add_argument("--prompts-per-step", type=int, default=GRPO().prompts, help="prompts per step (default %(default)s)")
  grpo.add_argument("--group-size", type=int, default=GRPO().group, help="completions per prompt (default %(default)s)")
  grpo.add_argument("--prompt-len", type=int, default=GRPO().prompt, help="the prompts' padded length (default %(default)s)")
  grpo.add_argument("--max-new-tokens", type=int, default=GRPO().completion,
                    help="completion tokens (default %(default)s)")
  grpo.add_argument("--beta", type=float, default=GRPO().beta,
                    help="the KL penalty's weight; > 0 holds the reference policy (default %(default)s)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--sweep", action="store_true", help="rank the meshes of --devices that fit")
  parser.add_argument("--devices", type=int, default=0, help="with --sweep: the device count")
  try:
    args = parser.parse_args(argv)
    _check(args)
  except ValueError as e:  # cli.UsageError too
    print(f"error: {e}", file=sys.stderr)
    return cli.EXIT_USAGE
  chunk = megabatch_bytes(args.megabatch_mib)
  kwargs = dict(optimizer=args.optimizer, rank_fraction=args.rank_fraction, fraction=args.fraction,
                global_batch=args.global_batch_size or 0, micro=args.micro_batch_size, seq_len=args.seq_len,
                gpu=args.gpu, per_node=args.gpus_per_node, mfu=args.mfu, dtype=args.dtype, loss_chunk=args.loss_chunk)
  if args.grpo:
    kwargs["grpo"] = GRPO(args.prompts_per_step, args.group_size, args.prompt_len, args.max_new_tokens, args.beta)
  try:
    kwargs["links"] = _links(args.links)
    kwargs["network"] = {"nvlink": _link("--nvlink", args.nvlink), "ib": _link("--ib", args.ib)}
    if args.sweep:
      if args.devices < 1:
        raise ValueError("--sweep needs --devices N (the device count to split)")
      if not args.global_batch_size:
        raise ValueError("--sweep needs --global-batch-size (it fixes the work every mesh splits)")
      if args.remat is not None or args.offload_optimizer:
        kwargs |= {"policies": [args.remat or "none"], "offloads": [args.offload_optimizer]}
      result: Any = sweep(args.model, args.devices, splits=[True] if args.dion_split_q else None,
                          megabatches=[chunk] if chunk else None, **kwargs)
    else:
      result = plan(args.model, args.mesh, remat=args.remat or "none", offload_optimizer=args.offload_optimizer,
                    split_q=args.dion_split_q, megabatch_bytes=chunk, **kwargs)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return cli.EXIT_USAGE
  text = json.dumps(result) if args.json else format_sweep(result) if args.sweep else format_plan(result)
  try:
    print(text, flush=True)
  except BrokenPipeError:  # `| head` closed the pipe: what it took is the answer, no traceback
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  return 0


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  sys.exit(main())
