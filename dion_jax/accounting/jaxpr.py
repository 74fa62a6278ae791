"""What a traced program runs, per run: its primitives and its matmul flops, loops unrolled.

Reads a ``jax.make_jaxpr`` / ``jit(...).trace(...).jaxpr`` program, following every
sub-program (jitted calls, ``shard_map`` bodies, custom rules): an equation inside a
``scan`` counts once per iteration, one inside a ``while`` loop (whose trip count is not
static) is reported apart; both branches of a ``cond`` count; a ``pallas_call`` counts
as one, its kernel body not at all. On a GPU each primitive below becomes one library call or
kernel launch: ``cholesky`` jaxlib's ``cusolver_potrf_ffi``, ``triangular_solve``
cuBLAS's trsm, ``geqrf`` / ``householder_product`` cuSOLVER's QR, ``pallas_call`` one
Triton kernel, ``dot_general`` one cuBLAS GEMM; so :func:`primitive_counts` of a step
traced as on a GPU is the list of what it asks the GPU for, without a GPU.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Iterator



def equations(program, times: int = 1, in_while: bool = False) -> Iterator[tuple[Any, int, bool]]:
  """``(eqn, runs, in_while)`` for every equation of ``program`` (a ClosedJaxpr or Jaxpr)
  and of its sub-programs: how many times it runs per run of ``program``, and whether it
  sits in a ``while`` body (then ``runs`` counts one trip)."""
  from jax.extend import core  # here: importing jax.extend loads Pallas, which import dion_jax must not

  for eqn in getattr(program, "jaxpr", program).eqns:
    yield eqn, times, in_while
    name = eqn.primitive.name
    if name == "pallas_call":  # one launch: its body runs on the device, not as ops
      continue
    inner_times = times * eqn.params["length"] if name == "scan" else times
    for sub in core.jaxprs_in_params(eqn.params):
      yield from equations(sub, inner_times, in_while or name == "while")


def primitive_counts(program) -> tuple[collections.Counter, collections.Counter]:
  """``(per_run, in_while)``: how many times each primitive runs per run of ``program``,
  and how many equations of each sit inside a ``while`` body (counted once each: their
  trip counts are not known)."""
  per_run, in_while = collections.Counter(), collections.Counter()
  for eqn, times, inside in equations(program):
    (in_while if inside else per_run)[eqn.primitive.name] += 1 if inside else times
  return per_run, in_while


def matmul_flops(program) -> int:
  """2 x the multiply-adds of every ``dot_general`` per run of ``program``; raises
  ValueError when one sits in a ``while`` loop (unknown trip count)."""
  total = 0
  for eqn, times, inside in equations(program):
    if eqn.primitive.name != "dot_general":
      continue
    if inside:
      raise ValueError("a matmul inside a while loop: its trip count is not static")
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
  return total
