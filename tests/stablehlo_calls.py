"""What a lowering's StableHLO runs inside loops and conditionals, followed through calls.

A factorization is a ``stablehlo.custom_call`` to the vendor library (``cusolver_potrf_ffi``,
``cusolver_geqrf_ffi``, ...) or a ``stablehlo.triangular_solve`` (cuBLAS trsm on a GPU). One
reached from a ``stablehlo.while`` body runs once per iteration: a loop over matrices.
Functions are followed through ``func.call``, so an op in a function called from a loop body
counts as in the loop.
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import jax
from jax._src.lib.mlir import ir  # jaxlib's MLIR bindings: the same ones tests/triton_ir.py uses

CONTROL_FLOW = ("stablehlo.while", "stablehlo.case", "stablehlo.if")
FACTORIZATIONS = ("stablehlo.custom_call", "stablehlo.triangular_solve")


class Reached(NamedTuple):
  """An op (a custom call's target, or the op name) and the control flow around it."""

  op: str
  inside: tuple[str, ...]  # enclosing ops from CONTROL_FLOW, outermost first


def _functions(module: ir.Operation) -> dict[str, ir.Operation]:
  body = module.regions[0].blocks[0]
  return {ir.StringAttr(op.attributes["sym_name"]).value: op for op in body.operations
          if op.operation.name == "func.func"}


def reached_ops(lowered: jax.stages.Lowered) -> list[Reached]:
  """Every factorization and control-flow op reached from ``main``, once per distinct
  (function, enclosing control flow) pair."""
  module = lowered.compiler_ir("stablehlo").operation
  functions, found, visited = _functions(module), [], set()

  def walk(op: ir.Operation, inside: tuple[str, ...]):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          name = inner.operation.name  # an OpView's .name can be its symbol
          if name == "stablehlo.custom_call":
            found.append(Reached(ir.StringAttr(inner.attributes["call_target_name"]).value, inside))
          elif name in FACTORIZATIONS or name in CONTROL_FLOW:
            found.append(Reached(name, inside))
          if name == "func.call":
            callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
            if (callee, inside) not in visited:
              visited.add((callee, inside))
              walk(functions[callee], inside)
          walk(inner, inside + (name,) if name in CONTROL_FLOW else inside)

  walk(functions["main"], ())
  return found


def factorization_calls(lowered: jax.stages.Lowered) -> collections.Counter:
  """How many times each factorization op is called from ``main``: every call site of a
  function counts its ops again (a loop's body counts once)."""
  module = lowered.compiler_ir("stablehlo").operation
  functions, per_function = _functions(module), {}

  def count(op: ir.Operation) -> collections.Counter:
    calls = collections.Counter()
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          name = inner.operation.name
          if name == "stablehlo.custom_call":
            name = ir.StringAttr(inner.attributes["call_target_name"]).value
          if is_factorization(name):
            calls[name] += 1
          if name == "func.call":
            callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
            if callee not in per_function:
              per_function[callee] = count(functions[callee])
            calls += per_function[callee]
          calls += count(inner)
    return calls

  return count(functions["main"])


def factorizations_in_loops(reached: list[Reached]) -> set[str]:
  """Vendor-library calls and triangular solves reached from a while loop's body or condition."""
  return {r.op for r in reached if "stablehlo.while" in r.inside and is_factorization(r.op)}


def is_factorization(op: str) -> bool:
  return op.startswith(("cusolver", "cublas", "lapack")) or op == "stablehlo.triangular_solve"
