r"""GPU evidence in one command: kernels, optimizer steps and training, as JSON and a PNG.

    python -m train.gpu                     # every stage
    python -m train.gpu --stages check,kernels --out /tmp/gpu
    python -m train.gpu --stages optimizers,train,profile,sampler --stage-seconds 120 \
        --out benchmarks/results/gpu/<device>   # issue 44's evidence

Stages (``--stages``); each reports, and the next runs even when one fails:

- ``check``: every Pallas kernel (RCQR's sketch, solve + Gram and solve; Newton–Schulz's
  symmetric products) and the whole RCQR and polar factor, Pallas and XLA, against
  float64 NumPy on the same inputs (the sketch's S from ``dion_jax.kernels.sketch``).
- ``kernels``: time of the Pallas path against XLA's composition of the same math
  (and Householder QR for RCQR), interleaved rounds. Both in ``train/gpu/kernels.py``.
- ``optimizers`` (``train/gpu/optimizers.py``): first, one step alone (update + apply,
  jitted, donated; the mean of 10 chained steps after 3 warm-up) on ``small``'s 72 matrices
  as the model stacks them, most wanted first (the stage's time may cut the list): Dion at
  rank 1/2, Muon, Dion at rank 1/2 with ``qr_precision="tensorfloat32x3"`` (the Cholesky QR
  passes on the tensor cores), Dion at rank 1/4 without and with it, optax's AdamW, Dion2
  (fraction 1/4), Dion at rank 1 (Dion's ``qr_method="auto"``), and Dion at rank 1/2 with
  ``qr_method="polar"`` and with ``power_precision="bfloat16"``: ms, the step's flops (``step_flops``), TFLOP/s and the
  time over Muon's; then microsoft/dion's PyTorch Dion (rank 1/2, 1/4, 1) and Muon on the
  same shapes and GPU when ``torch`` and its ``dion`` import (``train/gpu/reference.py``;
  else one line), side by side in ``optimizers.md``. Then, while the stage's time lasts,
  one step on one square n x n float32 matrix, n = 2048, 4096, ...: Dion at rank 1, 1/4
  and 1/16, Dion2 (fraction 1/4), NorMuon and Muon (bf16 Polar Express), optax's Muon and
  AdamW; the Dion paper's step-time-versus-size figure. A size that runs out of memory is
  recorded.
- ``moe``: ``jax.lax.ragged_dot`` (the experts' grouped matmul) checked against a loop over
  experts, then timed forward and backward in bf16 against one dense matmul of the same
  rows, 8 and 64 experts, even and skewed groups (``train/gpu/moe.py``).
- ``train``: the trainer (``python -m train.gpt``) in bfloat16 with cuDNN attention,
  ``small`` with AdamW, Dion2, Muon and Dion, ``350m`` and ``1b`` with AdamW and Dion, each
  AdamW and Dion also with ``--fp8`` ("adamw fp8", "dion fp8": the blocks' products in FP8,
  ``models/fp8.py``), with ``--fp8 delayed`` ("adamw fp8 delayed" on small and 350m, "dion
  fp8 delayed" on small: the scales from amax histories), and on small and 350m each Dion also with
  ``--dion-qr-precision tensorfloat32x3`` ("dion tf32x3"): tokens/s,
  model TFLOP/s, MFU against the device's dense bf16 peak and peak memory, from the last
  log interval; and the optimizer's share of the step: the trainer's own optimizer
  (update + apply, jitted alone, donated, on the model's parameters and same-shaped
  gradients) timed as the trainer times its steps, ``optimizer_ms / ms_per_step``.
- ``memory`` (``train/gpu/memory.py``): ``small`` and ``350m`` (bfloat16, cuDNN attention,
  one GPU, batch 8) under every recompute policy (``--remat``), with and without
  ``--offload-optimizer``: the compiled step's device and host memory (on a GPU the
  offloaded tensors are in pinned host memory, which XLA:CPU does not model), and the
  step's time over ``none``'s (the recompute's cost); ``python -m benchmarks.plan_memory
  --gpu-json OUT/gpu.json`` sets the planner's memory beside each row.
- ``profile``: a trace of Dion's steps 2 to 6 of ``small`` at its default rank (1/2 at
  width 768), taken by the trainer's own ``--profile-steps`` (``train/store/profiling.py``),
  summarized as the device's kernels by total time: where a step's time goes (the Triton
  ``cholesky_and_inverse`` leaf against the passes' GEMMs, for issue 44).
- ``sampler`` (``train/gpu/sampler.py``): GRPO's rollout, ``models.generate`` on ``small``
  with random weights, 64 prompts of 128 tokens, 256 new tokens each at temperature 1:
  tokens/s of the second call, beside transformers' ``generate`` of a GPT-2 of the same
  shape in bf16 on the same GPU (one line without transformers, torch or CUDA).

Each stage starts no new case after ``--stage-seconds``. Writes ``gpu.json`` after every
stage (and ``optimizers.md``, ``memory.md`` and ``sampler.md``, those stages' tables) and ``gpu.png`` at
the end, under ``--out`` (default ``gpu-evidence/<device>/`` in the working directory; the
repository keeps its runs in ``--out benchmarks/results/gpu/<device>``). Without a GPU it
says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

import jax

from train import cli
from train.cli import UsageError
from train.gpu import evidence, kernels, memory, moe, optimizers, sampler
from train.store import rundir

EXIT_NO_GPU = cli.EXIT_USAGE
STAGES = ("check", "kernels", "optimizers", "moe", "train", "memory", "profile", "sampler")
TABLES = {"optimizers": optimizers.markdown, "memory": memory.markdown, "sampler": sampler.markdown}  # stage: its markdown


def device_slug(kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def _args(argv: list[str] | None) -> argparse.Namespace:
  """The flags, checked (one ``error:`` line each, exit 2) before any stage starts."""
  parser = cli.Parser(prog="python -m train.gpu", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
  parser.add_argument("--out", help="output folder (default gpu-evidence/<device>)")
  parser.add_argument("--stage-seconds", type=float, default=80.0,
                      help="time after which a stage starts no new case (default 80)")
  parser.add_argument("--max-size", type=int, default=16384, help="largest n of the optimizers stage (default 16384)")
  parser.add_argument("--train-steps", type=int, default=30, help="trainer steps per run (default 30)")
  args = parser.parse_args(argv)
  unknown = set(args.stages.split(",")) - set(STAGES)
  if unknown:
    raise UsageError(f"--stages {args.stages}: unknown {', '.join(map(repr, sorted(unknown)))}; choose from"
                     f" {','.join(STAGES)}")
  for name in ("stage_seconds", "max_size", "train_steps"):
    if not getattr(args, name) > 0:
      raise UsageError(f"{rundir.flag_name(name)} must be positive, got {getattr(args, name)}")
  if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
    raise UsageError(f"--out {args.out} is a file, not a folder; choose a folder")
  if jax.default_backend() != "gpu":
    raise UsageError(f"no GPU here (JAX's default backend is {jax.default_backend()}); run this on an NVIDIA GPU")
  return args


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: _args(argv), lambda args: _evidence(args, argv))


def _evidence(args: argparse.Namespace, argv: list[str] | None) -> int:
  stages = args.stages.split(",")
  device = jax.devices()[0].device_kind
  out = args.out or os.path.join("gpu-evidence", device_slug(device))
  os.makedirs(out, exist_ok=True)
  results = {"device": device, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
             "command": "python -m train.gpu " + " ".join(argv if argv is not None else sys.argv[1:])}
  functions = {"check": kernels.stage_check, "kernels": kernels.stage_kernels,
               "optimizers": optimizers.stage_optimizers, "moe": moe.stage_moe, "train": evidence.stage_train,
               "memory": memory.stage_memory, "profile": evidence.stage_profile, "sampler": sampler.stage_sampler}
  for name in stages:
    print(f"== {name}", flush=True)
    t0 = time.monotonic()
    try:
      results[name] = functions[name](args)
    except Exception as e:  # noqa: BLE001 (one stage's failure is reported, the others still run)
      traceback.print_exc()
      results[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    results[name]["seconds"] = round(time.monotonic() - t0, 1)
    if name in TABLES and "error" not in results[name]:
      with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(TABLES[name](results[name]) + "\n")
    with open(os.path.join(out, "gpu.json"), "w") as f:
      json.dump(results, f, indent=1)
  evidence.plot(results, os.path.join(out, "gpu.png"))
  print(f"wrote {out}/gpu.json and gpu.png", flush=True)
  return 0


if __name__ == "__main__":
  cli.exit(main())
