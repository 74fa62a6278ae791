"""What one optimizer step on ``small`` asks a GPU for, counted on any machine.

    python -m benchmarks.dion_cuda_structure [--out benchmarks/results/dion_gpu_path/structure.md]

Traces each optimizer's update + apply on ``small``'s parameters (the GPT's tree: Dion's
72 matrices in 4 megabatches, AdamW for embeddings, head and norms) as on a GPU
(``jax.default_backend()`` reads ``"gpu"`` while tracing, as in
``tests/test_train_run_cuda_lowering.py``) and counts with
``dion_jax.accounting.primitive_counts`` what one step runs:

- library calls and what jaxlib and XLA make of a batched one (``dion_jax.linalg.cholesky``
  has the sources): ``cholesky`` (cuSOLVER's batched potrf: a copy, a pointer kernel and
  about 2n/16 launches for n x n), ``triangular_solve`` (cuBLAS's batched trsm: two
  pointer kernels and n/64 launches), ``geqrf`` / ``householder_product`` (cuSOLVER QR);
  their launches per step are estimated from those counts (H100 profile of
  ``benchmarks/results/gpu``);
- ``pallas_call``: one Triton kernel each; ``dot_general``: one GEMM each;
- ``while`` loops (a host round trip per trip on XLA:GPU) and the data movement of the
  megabatch's stack and unstack and of the blocked factorization: ``stack``,
  ``concatenate``, ``slice``, ``gather``, ``transpose`` (XLA fuses many of them into their
  neighbours; these are upper bounds on copies).
"""
from __future__ import annotations

import argparse
import math
from unittest import mock

import jax
import jax.numpy as jnp
import optax

import dion_jax
import models
from dion_jax import accounting

COLUMNS = ("cholesky", "triangular_solve", "geqrf", "pallas_call", "dot_general", "stack", "concatenate", "slice",
           "gather", "transpose")


def library_launches(program) -> int:
  """Kernel launches of the step's cuSOLVER and cuBLAS factorizations (module docstring)."""
  launches = 0
  for eqn, times, _ in accounting.jaxpr.equations(program):
    if eqn.primitive.name not in ("cholesky", "triangular_solve"):
      continue
    shape = eqn.invars[0].aval.shape
    batch, n = math.prod(shape[:-2]), shape[-1]
    if eqn.primitive.name == "cholesky":
      launches += times * (2 + 2 * -(-n // 16) - 1 if batch > 1 else 2 * -(-n // 16) - 1)
    elif eqn.primitive.name == "triangular_solve":
      launches += times * ((2 if batch > 1 else 0) + -(-n // 64))
  return launches


def step_program(tx, params):
  grads = jax.tree.map(jnp.zeros_like, params)

  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with mock.patch.object(jax, "default_backend", lambda: "gpu"):
    return jax.make_jaxpr(step)(params, jax.eval_shape(tx.init, params))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.dion_cuda_structure",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--rank-fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
  parser.add_argument("--qr-methods", nargs="+", default=["auto", "polar"])
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  _, params = models.abstract(models.preset("small"))
  runs = [(f"dion {rf:g} {m}", dion_jax.dion(0.02, rank_fraction=rf, qr_method=m))
          for rf in args.rank_fractions for m in args.qr_methods]
  runs += [("muon", dion_jax.muon(0.02)), ("dion2 1/4", dion_jax.dion2(0.02)), ("adamw", optax.adamw(3e-3))]
  lines = ["| step | " + " | ".join(COLUMNS) + " | in while loops | factorization launches |",
           "|---|" + "---|" * (len(COLUMNS) + 2)]
  for name, tx in runs:
    program = step_program(tx, params)
    per_run, in_while = accounting.primitive_counts(program)
    cells = " | ".join(str(per_run.get(c, 0)) for c in COLUMNS)
    lines.append(f"| {name} | {cells} | {sum(in_while.values())} | {library_launches(program)} |")
    print(lines[-1], flush=True)
  text = "\n".join(lines)
  if args.out:
    with open(args.out, "w") as f:
      f.write(f"`python -m benchmarks.dion_cuda_structure {' '.join(argv or [])}`\n\n{text}\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
