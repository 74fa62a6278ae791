"""The loss of a model on data: ``python -m train.eval (RUN_DIR | hf:DIR) [--data SPEC]``.

Prints ``validation lm loss: X | validation lm loss PPL: exp(X) | targets: N`` (the words
of the trainer's validation line) of a run's checkpoint (the latest, or ``--step``) or of
a Hugging Face checkpoint directory, on one device or, with ``--mesh``, sharded over the
devices as the trainer shards it (each process reading only its devices' slices of the
weights; a model too large for one device), on several hosts with the trainer's
``--coordinator``/``--num-processes``/``--process-id`` (process 0 prints).

The number is the trainer's validation loss, computed by the same functions
(``train/run/evaluation.py``): on a run directory with no flags but the run, the data, the
``--eval-tokens``, the ``--seq-len``, the packing and the document masking are the run's,
so the line repeats the run's last validation loss (``metrics.jsonl``'s ``val_loss``). It
is meant to be recomputable by anyone: of token data, the first ``--eval-tokens`` N // T
windows in order, window i of a stream holding its tokens [i·T, i·T + T] (T = ``--seq-len``
inputs, the targets shifted by one), N // T · T targets; the loss is the mean over every
target, in float64 over float32 per-token losses (the language-model loss only: a
mixture's router losses are left out). Fine-tuning data (``--data sft:FILE.jsonl``,
prompt/completion lines or conversations) is read whole, with the model's tokenizer and
chat template, and packed into rows as the trainer packs it: the loss is then the mean
over the learned targets (completions, assistant turns) of every example, each once.

While it works it says on stderr how many rows it evaluates (the compile and the passes
take seconds to minutes). Bad input prints one ``error: ...`` line on stderr and exits with
code 2.
"""
from __future__ import annotations

import argparse
import sys

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import data
import dion_jax
import models
from models import context
from train import cli
from train.cli import UsageError
from train.run import config as config_lib
from train.run import evaluation, flags, start
from train.run import model_source as model_source_lib
from train.run import setup as setup_lib
from train.run import step as step_lib
from train.store import log


def _parallelism(spec: str | None, batch_size: int) -> models.Parallelism:
  """The mesh of ``--mesh`` (one device by default), checked against the batch."""
  mesh = setup_lib.make_mesh(spec or "fs=1")
  sizes = dict(mesh.shape)
  pp, dp = sizes["pp"], sizes["rp"] * sizes["fs"] * sizes["ep"]
  if batch_size % (dp * pp):
    raise UsageError(f"--batch-size {batch_size} does not split over the {dp} data-parallel ranks"
                     f" (rp x fs x ep) and {pp} pipeline micro-batches; choose a multiple of {dp * pp}")
  return models.Parallelism(mesh, microbatches=pp)


def _parser() -> argparse.ArgumentParser:
  parser = cli.Parser(prog="python -m train.eval",
                      description="Print the validation loss of a checkpoint on a data spec: the mean"
                                  " token loss over every counted target (an sft: file's learned"
                                  " targets), each row once, as the trainer's validation computes it.")
  parser.add_argument("model", metavar="RUN_DIR|hf:DIR|hf:ORG/NAME",
                      help="a python -m train.gpt run directory, hf:DIR for a Hugging Face checkpoint folder, or hf:ORG/NAME[@REVISION] a Hub id")
  parser.add_argument("--data", default=None, metavar="SPEC",
                      help="data spec as train.gpt's --data (stdlib:val, fineweb:GLOB, megatron:PREFIX,"
                           " or sft:FILE.jsonl, read whole with the model's tokenizer); default: a run's"
                           " validation data (its --valid-data), needed for hf:DIR")
  parser.add_argument("--eval-tokens", "--tokens", dest="eval_tokens", type=int, default=None,
                      help="validation targets of token data, as train.gpt's --eval-tokens: the first"
                           " N // --seq-len windows (default: the run's --eval-tokens, 16384 for hf:DIR;"
                           " sft: files are read whole)")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="tokens per window (default: the run's --seq-len; for hf:DIR, as"
                           " train.gpt's: its max_position_embeddings, at most 1024)")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="windows per forward pass (default 8; for a run trained with --fp8, its own"
                           " validation's: --global-batch-size, in its micro-batches; FP8 scales each"
                           " product by its amax over the rows it multiplies, so the loss follows them)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step of RUN_DIR (default: the latest)")
  parser.add_argument("--mesh", default=None, metavar="SPEC",
                      help="shard the model as train.gpt does, e.g. fs=2,tp=2 (default: one device;"
                           " --batch-size must split over rp x fs x ep x pp)")
  for name in ("coordinator", "num_processes", "process_id"):
    parser.add_argument(f"--{name.replace('_', '-')}", type=int if name != "coordinator" else str,
                        default=None, help=flags.HELP[name])
  parser.add_argument("--distributed", action="store_true", help=flags.HELP["distributed"])
  return parser


def _start(argv):
  args = _parser().parse_args(argv)
  for name in ("eval_tokens", "seq_len", "batch_size"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  # The trainer's checks and start of the multi-host runtime (the mesh spans every process).
  runtime = config_lib.Config(mesh=args.mesh, coordinator=args.coordinator, num_processes=args.num_processes,
                              process_id=args.process_id, distributed=args.distributed)
  runtime.check()
  start.start_jax(runtime)
  origin = model_source_lib.resolve(args.model)
  saved = config_lib.saved_config(origin.run_dir) if origin.run_dir else {}
  # A run's own validation settings, that the line repeat its validation loss.
  run = config_lib.Config(**{k: v for k, v in saved.items()
                             if k in ("data", "valid_data", "eval_tokens", "pack", "document_mask")})
  batch_size, accum = (args.batch_size, 1) if args.batch_size else _trainer_pass(saved) or (8, 1)
  par = _parallelism(args.mesh, batch_size)
  spec = args.data or (run.valid_spec if origin.run_dir else None)
  if spec is None:
    raise UsageError(f"{args.model} records no validation data; pass --data SPEC (e.g. --data stdlib:val)")
  with jax.set_mesh(par.mesh):
    cfg, graphdef, params, _ = origin.load(args.step, par, args.seq_len)
  seq_len = args.seq_len or cfg.seq_len
  try:
    context.check_seq_len(seq_len, par.cp)
  except ValueError as e:
    raise UsageError(f"--seq-len / --mesh: {e}") from None
  source = data.load_source(config_lib.strip_format(spec), progress=False, tokenizer=origin.tokenizer,
                            packed=run.pack)
  # A run that validated nothing (--eval-tokens 0) is evaluated on the default count.
  r = evaluation.rows(source, seq_len, args.eval_tokens or run.eval_tokens or config_lib.Config().eval_tokens,
                      origin.tokenizer.eod if run.document_mask else None)
  largest = max(int(r["inputs"].max()), int(r["targets"].max()))
  if largest >= cfg.vocab_size:
    raise UsageError(f"--data {spec} holds token id {largest} but the model's vocabulary has"
                     f" {cfg.vocab_size} ids (0..{cfg.vocab_size - 1}); evaluate on data made with"
                     " the model's tokenizer")
  return graphdef, params, r, par, batch_size, accum if par.pp == 1 else 1


def _trainer_pass(saved: dict) -> tuple[int, int] | None:
  """An FP8 run's validation pass: its rows (the trainer's --global-batch-size) and its
  micro-batches (rows i, i + M, ...; ``step.split_micro``), on the run's --mesh (by default all
  of this host's devices, as the trainer's); None for a run without FP8. FP8 scales each
  product by its amax over the rows it multiplies, so the loss follows how they are grouped."""
  if saved.get("fp8") in (None, False, "none"):
    return None
  sizes = dion_jax.parse_mesh_spec(saved.get("mesh") or f"fs={len(jax.devices())}")
  rows = saved["global_batch_size"]
  per_rank = rows // (sizes["rp"] * sizes["fs"] * sizes["ep"])
  # A pipeline validates through its own micro-batches, one device's passes whole.
  micro = (saved.get("micro_batch_size") or per_rank) if sizes["pp"] == 1 else per_rank
  return rows, max(per_rank // micro, 1)


def _report(loaded) -> int:
  graphdef, params, r, par, batch_size, accum = loaded
  if jax.process_index() == 0:  # the compile and the passes take a while: say what is coming
    print(f"evaluating {len(r['inputs'])} rows of {r['inputs'].shape[1]} tokens, {batch_size} a pass"
          " (compiling the evaluation step first)", file=sys.stderr, flush=True)
  with jax.set_mesh(par.mesh):
    loss, count = evaluation.mean_loss(step_lib.make_eval_step(graphdef, par, accum), params, r, batch_size,
                                       NamedSharding(par.mesh, P(models.BATCH_AXES)))
  if jax.process_index() != 0:
    return 0
  print(f"{log.validation_fields(loss, count)} | rows: {len(r['inputs'])} x {r['inputs'].shape[1]} tokens")
  return 0


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: _start(argv), _report, interrupted="interrupted; train.eval writes no files", read_only=True)


if __name__ == "__main__":
  cli.exit(main())
