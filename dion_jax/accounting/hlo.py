"""Communication accounting: the bytes each collective of a compiled program moves,
grouped by the mesh axes it communicates over.

Reads the optimized HLO text of a compiled function
(``jax.jit(f).lower(*args).compile().as_text()``) and, for every all-reduce,
reduce-scatter, all-gather, all-to-all and collective-permute instruction, finds

- its payload per device: the bytes of its operands (all-reduce, reduce-scatter,
  all-to-all, collective-permute), or of its output for all-gather (operand bytes
  times the group size); tuple-shaped (variadic) collectives sum their elements;
- the mesh axes it runs over: the axes along which the devices of one replica
  group (or one source-target pair of a collective-permute) differ.

Conventions and limits:

- Device ids in the replica groups of an SPMD-partitioned module are partition
  (logical) ids, i.e. positions in ``mesh.devices.flat``, not ``Device.id``.
- Each instruction counts once, where it appears in the text: a collective in a
  while-loop body counts once, not once per iteration, and both branches of a
  conditional count. With ``trip_counts=True`` a collective counts once per run of
  its computation instead: a loop body's as many times as the trip count XLA knows
  (``known_trip_count``; nested loops multiply), so that bytes are per step, e.g. of
  a scan over micro-batches.
- Async pairs count once, at their ``-start`` (``-done`` is skipped); a collective
  wrapped in an ``async-start`` computation counts where it appears, inside.
- Three replica-group formats are read (``dion_jax.accounting.replica_groups``):
  explicit lists ``{{0,4},{1,5}}``, iota lists ``[4,2]<=[2,2,2]T(0,2,1)``, and Shardy
  mesh-axes lists ``mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_0'}``.
  Anything else raises ValueError rather than being skipped.
- Groups of one device (e.g. self pairs of a collective-permute) are reported with
  axes ``()``; their bytes never leave the device.

Example lines (jax 0.10.2, CPU, mesh rp=2,fs=2,tp=2)::

  f32[64,32]{1,0} all-reduce(%param.1), channel_id=1,
      replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, ...
  f32[64,64]{1,0} all-reduce(%ynn_fusion), channel_id=2,
      replica_groups=[4,2]<=[2,2,2]T(0,2,1), use_global_device_ids=true, ...
  f32[32]{0} all-reduce(%wrapped_reduce), channel_id=1,
      replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_0'}, ...
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax

from dion_jax.accounting.replica_groups import closing, group_axes, replica_groups, split_top_level

OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


class CollectiveStat(NamedTuple):
  """All collectives of one kind over one set of mesh axes.

  Attributes:
    op: the HLO opcode without an async suffix, one of OPS.
    axes: the mesh axes the devices of a group differ along, in mesh order.
    count: the number of instructions (each counted once, or once per run with
      ``trip_counts``; see the module doc).
    bytes: their summed payload per device.
    wire_bytes: the bytes each device sends under the ring algorithms, for groups
      of g devices and payload N: all-reduce 2(g-1)/g·N, reduce-scatter,
      all-gather and all-to-all (g-1)/g·N, collective-permute N. This is the
      measure under which a reduce-scatter plus an all-gather cost one all-reduce.
  """
  op: str
  axes: tuple[str, ...]
  count: int
  bytes: int
  wire_bytes: int = 0


def _wire_bytes(op: str, payload: int, group_size: int) -> int:
  if op == "collective-permute":
    return payload if group_size > 1 else 0
  factor = 2 if op == "all-reduce" else 1
  return factor * payload * (group_size - 1) // group_size


_DTYPE_BITS = {
    "pred": 8, "token": 0,
    "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8,
    "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
}

_INSTR_RE = re.compile(r"\s*(?:ROOT\s+)?%?(?P<name>[^\s=(){}]+)\s*=\s*(?P<rest>.*)")
_ARRAY_RE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPCODE_RE = re.compile(r"\s*(?P<op>[a-z][a-z0-9\-]*)\(")
_COMMENT_RE = re.compile(r"/\*.*?\*/")  # long operand lists carry /*index=5*/ markers

def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: ``f32[64,32]{1,0}``, ``(bf16[8], s32[])``, ..."""
  bits = 0
  for m in _ARRAY_RE.finditer(shape):
    dtype = m["dtype"]
    if dtype not in _DTYPE_BITS:
      raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
    dims = [int(d.replace("<=", "")) for d in m["dims"].split(",") if d.strip()]
    bits += _DTYPE_BITS[dtype] * math.prod(dims)
  return (bits + 7) // 8


class _Instr(NamedTuple):
  """A collective instruction; op without its -start suffix; the computation it is in."""
  name: str
  op: str
  operands: list[str]
  attrs: str
  computation: str = ""


_COMPUTATION_RE = re.compile(r"(?P<entry>ENTRY\s+)?%?(?P<name>[^\s=(){}]+)\s.*\{\s*$")
_CALLED_RE = re.compile(
    r"\b(?P<key>body|condition|calls|to_apply|true_computation|false_computation)=%?(?P<name>[^\s,{}()]+)"
    r"|\bbranch_computations=\{(?P<branches>[^}]*)\}")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


def _runs(hlo: str) -> dict[str, int]:
  """How many times each computation runs per run of the entry computation: a while
  loop's body and condition its known trip count times per run of the loop."""
  calls: dict[str, list[tuple[str, int]]] = {}  # computation -> (callee, times per run)
  entry, current = None, None
  for line in hlo.splitlines():
    line = _COMMENT_RE.sub("", line)
    if not line.startswith((" ", "\t")) and (m := _COMPUTATION_RE.match(line)):
      current = m["name"]
      entry = current if m["entry"] else entry
      calls.setdefault(current, [])
      continue
    if current is None:
      continue
    for m in _CALLED_RE.finditer(line):
      if m["branches"] is not None:
        calls[current] += [(b.strip().lstrip("%"), 1) for b in m["branches"].split(",") if b.strip()]
        continue
      times = 1
      if m["key"] in ("body", "condition"):
        trip = _TRIP_COUNT_RE.search(line)
        if trip is None:
          raise ValueError(f"a while loop of {current} has no known trip count; count with trip_counts=False")
        times = int(trip["n"])
      calls[current].append((m["name"], times))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for callee, per_run in calls.get(name, []):
      visit(callee, times * per_run)

  visit(entry, 1)
  return runs


def _parse_instructions(hlo: str) -> tuple[dict[str, str], list[_Instr]]:
  """The shape of every named instruction, and the collectives in full."""
  shapes, collectives = {}, []
  computation = ""
  for line in hlo.splitlines():
    if not line.startswith((" ", "\t")) and (c := _COMPUTATION_RE.match(_COMMENT_RE.sub("", line))):
      computation = c["name"]
      continue
    m = _INSTR_RE.fullmatch(_COMMENT_RE.sub("", line))
    if not m:
      continue
    rest = m["rest"]
    end = closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    op_m = _OPCODE_RE.match(rest, end) if end > 0 else None
    if not op_m:
      continue
    shapes[m["name"]] = rest[:end]
    if op_m["op"].removesuffix("-start") not in OPS:
      continue
    open_paren = op_m.end() - 1
    close = closing(rest, open_paren)
    collectives.append(_Instr(m["name"], op_m["op"].removesuffix("-start"),
                              split_top_level(rest[open_paren + 1:close - 1]), rest[close:], computation))
  return shapes, collectives


def _operand_bytes(instr: _Instr, shapes: dict[str, str]) -> int:
  total = 0
  for operand in instr.operands:
    if "[" in operand:  # printed with its shape: "f32[64,32]{1,0} %x"
      total += shape_bytes(operand)
      continue
    name = operand.lstrip("%")
    if name not in shapes:
      raise ValueError(f"operand {operand!r} of {instr.name} is not defined in the HLO text")
    total += shape_bytes(shapes[name])
  return total


def _hlo_text(compiled_or_hlo_text: Any) -> str:
  if isinstance(compiled_or_hlo_text, str):
    return compiled_or_hlo_text
  if hasattr(compiled_or_hlo_text, "compile"):  # jax.stages.Lowered: StableHLO is not HLO
    compiled_or_hlo_text = compiled_or_hlo_text.compile()
  return compiled_or_hlo_text.as_text()


def collective_stats(compiled_or_hlo_text: Any, mesh: jax.sharding.Mesh,
                     trip_counts: bool = False) -> list[CollectiveStat]:
  """Counts the collectives of a compiled program and the bytes they move.

  Args:
    compiled_or_hlo_text: a ``jax.stages.Compiled`` (or ``Lowered``, compiled
      here), or its optimized HLO text.
    mesh: the mesh the program was compiled for.
    trip_counts: count each collective once per run of its computation (a loop
      body's, its trip count times), not once per instruction (module doc).

  Returns:
    One CollectiveStat per (op, axes), ordered by OPS and then by mesh axes;
    bytes are per device (see the module doc for the conventions).

  Raises:
    ValueError: for a replica-group format, element type or operand that cannot
      be read, or a module partitioned for a different number of devices; with
      ``trip_counts``, for a loop whose trip count XLA does not know.
  """
  hlo = _hlo_text(compiled_or_hlo_text)
  n_devices = mesh.devices.size
  partitions = re.search(r"\bnum_partitions=(\d+)", hlo)
  if partitions and int(partitions[1]) not in (1, n_devices):
    raise ValueError(
        f"the HLO module has num_partitions={partitions[1]} but the mesh has {n_devices}"
        " devices; pass the mesh the function was compiled for")
  shapes, collectives = _parse_instructions(hlo)
  runs = _runs(hlo) if trip_counts else {}
  totals: dict[tuple[str, tuple[str, ...]], list[int]] = {}
  for instr in collectives:
    groups = replica_groups(instr.attrs, instr.op, n_devices)
    nbytes = _operand_bytes(instr, shapes)
    if instr.op == "all-gather":
      nbytes *= len(groups[0])
    if trip_counts and instr.computation not in runs:
      raise ValueError(f"{instr.name} is in {instr.computation!r}, which the entry computation never calls")
    times = runs[instr.computation] if trip_counts else 1
    entry = totals.setdefault((instr.op, group_axes(groups, mesh)), [0, 0, 0])
    entry[0] += times
    entry[1] += times * nbytes
    entry[2] += times * _wire_bytes(instr.op, nbytes, len(groups[0]))
  order = {a: i for i, a in enumerate(mesh.axis_names)}
  keys = sorted(totals, key=lambda k: (OPS.index(k[0]), len(k[1]), [order[a] for a in k[1]]))
  return [CollectiveStat(op, axes, *totals[op, axes]) for op, axes in keys]


def bytes_by_axes(stats: Iterable[CollectiveStat], field: str = "bytes") -> dict[tuple[str, ...], int]:
  """Total bytes per device over each set of mesh axes, all ops together; ``field``
  ``"bytes"`` (payload) or ``"wire_bytes"``."""
  totals: dict[tuple[str, ...], int] = {}
  for s in stats:
    totals[s.axes] = totals.get(s.axes, 0) + getattr(s, field)
  return totals


def format_table(stats: Sequence[CollectiveStat]) -> str:
  """A plain-text table of `stats` with a total row; axes () print as '-'."""
  rows = [("op", "axes", "count", "bytes")]
  rows += [(s.op, ",".join(s.axes) or "-", str(s.count), f"{s.bytes:,}") for s in stats]
  rows.append(("total", "", str(sum(s.count for s in stats)), f"{sum(s.bytes for s in stats):,}"))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  return "\n".join(
      f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"
      for r in rows)
