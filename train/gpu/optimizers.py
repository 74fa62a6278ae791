"""The ``optimizers`` stage of ``python -m train.gpu``: one optimizer step alone (update +
apply) on ``small``'s 72 matrices, then on square matrices of growing size.

``small``'s set, first: the matrices Dion takes in the ``small`` GPT, read from the model
itself: its parameters built abstractly (``models.abstract``), the leaves that
``dion_jax.default_labels`` routes to ``"dion"``, stacked as the model stacks them
(``[1 stage, 12 layers, m, n]`` for query, key, value and out, 768 x 768, up 768 x 3072
and down 3072 x 768), float32, random. Every optimizer takes all of them and nothing else
(AdamW too: no embeddings). Each row is the mean of 10 chained steps after 3 warm-up
steps, jitted with parameters and state donated (``timing.donated_update``,
``timing.throughput_time``), as issue 44's table; the step's flops from
``dion_jax.optimizers.flops.step_flops`` (Dion's ``"auto"`` resolved as it is when
traced: ``shifted_cqr`` on a GPU), the effective TFLOP/s (flops / time) and the time over
our Muon's. microsoft/dion's PyTorch Dion and Muon follow on the same shapes
(``train/gpu/reference.py``), then the square sweep (the Dion paper's step time against
size) with the stage's time that is left.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dion_jax
import models
from dion_jax.linalg import resolve_method
from dion_jax.optimizers.flops import step_flops
from train.gpu import reference
from train.gpu.timing import donated_update, jitted_step, throughput_time, time_fn

STEPS, WARMUP = 10, 3
_ALL_MATRICES = {"labels": lambda params: jax.tree.map(lambda _: "dion", params)}
_FLOP_OPTIONS = set(inspect.signature(step_flops).parameters) - {"optimizer", "shapes"}

# --- small's set -------------------------------------------------------------------


def matrix_set(preset: str = "small") -> dict[str, jax.ShapeDtypeStruct]:
  """The preset's parameters that Dion takes, as the model stacks them, by path."""
  _, shapes = models.abstract(models.preset(preset))
  labels = dion_jax.default_labels(shapes)
  return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
          for (path, leaf), label in zip(jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(labels))
          if label == "dion"}


def matrix_shapes(params: dict[str, Any]) -> list[tuple[int, int]]:
  """One (m, n) per matrix: a stacked leaf's leading axes are that many matrices."""
  return [tuple(p.shape[-2:]) for p in params.values() for _ in range(math.prod(p.shape[:-2]))]


def random_matrices(abstract: dict[str, jax.ShapeDtypeStruct], seed: int = 0) -> dict[str, jax.Array]:
  """Normal entries over sqrt(fan_in), the shapes and dtypes of ``abstract``."""
  keys = jax.random.split(jax.random.key(seed), len(abstract))
  return {name: jax.random.normal(key, a.shape, a.dtype) / np.sqrt(a.shape[-2])
          for key, (name, a) in zip(keys, abstract.items())}


@dataclasses.dataclass(frozen=True)
class Case:
  """One optimizer of the table: ``optimizer`` one of ``step_flops``'s, ``options`` the
  keyword arguments of its ``dion_jax`` constructor (those ``step_flops`` knows count)."""
  name: str
  optimizer: str
  options: dict = dataclasses.field(default_factory=dict)

  def make(self) -> optax.GradientTransformation:
    if self.optimizer == "adamw":
      return optax.adamw(1e-3)
    return getattr(dion_jax, self.optimizer)(0.01, **self.options, **_ALL_MATRICES)

  def flops(self, shapes: list[tuple[int, int]]) -> int:
    options = {k: v for k, v in self.options.items() if k in _FLOP_OPTIONS}
    if self.optimizer == "dion":
      options["qr_method"] = resolve_method(options.get("qr_method", "auto"))
    return step_flops(self.optimizer, shapes, **options)["total"]


# Most wanted first (the stage's time may end the list): issue 44's targets are Dion 1/2 and
# 1/4 against Muon.
# The tf32x3 rows are the candidate GPU default: the Cholesky QR passes on the tensor cores.
CASES = (
    Case("dion r=1/2", "dion", {"rank_fraction": 0.5}),
    Case("muon", "muon"),
    Case("dion r=1/2 tf32x3 passes", "dion", {"rank_fraction": 0.5, "qr_precision": "tensorfloat32x3"}),
    Case("dion r=1/4", "dion", {"rank_fraction": 0.25}),
    Case("dion r=1/4 tf32x3 passes", "dion", {"rank_fraction": 0.25, "qr_precision": "tensorfloat32x3"}),
    Case("optax adamw", "adamw"),
    Case("dion2 1/4", "dion2", {"fraction": 0.25}),
    Case("dion r=1", "dion", {"rank_fraction": 1.0}),
    Case("dion r=1/2 polar", "dion", {"rank_fraction": 0.5, "qr_method": "polar"}),
    Case("dion r=1/2 bf16 power", "dion", {"rank_fraction": 0.5, "power_precision": "bfloat16"}),
)


def rate_row(name: str, implementation: str, seconds: float, flops: int) -> dict:
  """One row of the table: time, flops and their rate."""
  return {"optimizer": name, "implementation": implementation, "ms": seconds * 1e3, "gflop": flops / 1e9,
          "tflops": flops / seconds / 1e12}


def add_muon_ratio(rows: list[dict]) -> list[dict]:
  """Each timed row's time over its implementation's Muon's (None without one)."""
  muon = {r["implementation"]: r["ms"] for r in rows if r["optimizer"] == "muon" and "ms" in r}
  for row in rows:
    if "ms" in row:
      row["vs_muon"] = row["ms"] / muon[row["implementation"]] if row["implementation"] in muon else None
  return rows


def time_set(abstract: dict[str, jax.ShapeDtypeStruct], cases=CASES, deadline: float = math.inf,
             steps: int = STEPS, warmup: int = WARMUP) -> list[dict]:
  """dion_jax's rows on the matrices of ``abstract`` (module docstring); a case that fails
  is a row with its error, and none starts after ``deadline``."""
  shapes, rows = matrix_shapes(abstract), []
  for case in cases:
    if time.monotonic() > deadline:
      break
    try:
      tx, params = case.make(), random_matrices(abstract)
      grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape, p.dtype) * 1e-2, params)
      seconds = throughput_time(donated_update(tx, grads), (params, tx.init(params)), steps, warmup)
      rows.append(rate_row(case.name, "dion_jax", seconds, case.flops(shapes)))
    except Exception as e:  # noqa: BLE001 (one optimizer's failure is a row; the others still run)
      traceback.print_exc()
      rows.append({"optimizer": case.name, "implementation": "dion_jax",
                   "error": f"{type(e).__name__}: {str(e)[:500]}"})
    print("  " + row_line(rows[-1]), flush=True)
  return rows


def row_line(row: dict) -> str:
  if "error" in row:
    return f"{row['implementation']} {row['optimizer']}: {row['error']}"
  return (f"{row['implementation']} {row['optimizer']}: {row['ms']:.2f} ms, {row['gflop']:.1f} GFLOP,"
          f" {row['tflops']:.1f} TFLOP/s")


# --- the square sweep --------------------------------------------------------------


def sweep_optimizers() -> dict[str, Callable[[], optax.GradientTransformation]]:
  """Each optimizer of the sweep's figure, applied to every leaf (one square matrix)."""
  muon_dims = optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
  return {
      "dion r=1": lambda: dion_jax.dion(0.01, rank_fraction=1.0, **_ALL_MATRICES),
      "dion r=1/4": lambda: dion_jax.dion(0.01, rank_fraction=0.25, **_ALL_MATRICES),
      "dion r=1/16": lambda: dion_jax.dion(0.01, rank_fraction=1 / 16, **_ALL_MATRICES),
      "dion2 1/4": lambda: dion_jax.dion2(0.01, fraction=0.25, **_ALL_MATRICES),
      "nordion2 1/4": lambda: dion_jax.nordion2(0.01, fraction=0.25, **_ALL_MATRICES),
      "normuon": lambda: dion_jax.normuon(0.01, **_ALL_MATRICES),
      "muon": lambda: dion_jax.muon(0.01, **_ALL_MATRICES),
      "optax muon": lambda: optax.contrib.muon(0.01, muon_weight_dimension_numbers=lambda p: jax.tree.map(
          lambda _: muon_dims, p)),
      "optax adamw": lambda: optax.adamw(1e-3),
  }


def _out_of_memory(error: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def sweep(max_size: int, deadline: float) -> tuple[list[dict], bool]:
  """Median ms of one step on one n x n float32 matrix, n = 2048, 4096, ... up to
  ``max_size`` while time lasts; and whether it reached ``max_size``."""
  rows, gone = [], set()  # gone: optimizers that ran out of memory at a smaller size
  n = 2048
  while n <= max_size and time.monotonic() < deadline:
    params = {"w": jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / np.sqrt(n)}
    row = {"n": n}
    for name, make in sweep_optimizers().items():
      if name in gone or time.monotonic() > deadline:
        continue
      try:
        step, step_args, _ = jitted_step(make(), params)
        row[name] = time_fn(step, step_args, repeats=9, warmup=2) * 1e3
        del step_args
      except Exception as e:  # noqa: BLE001 (a size that does not fit ends that optimizer's curve)
        if not _out_of_memory(e):
          raise
        gone.add(name)
        row[name] = "out of memory"
    rows.append(row)
    print(f"  n={n:6d} " + " | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items() if k != "n") + " (ms)", flush=True)
    n *= 2
  return rows, n > max_size


# --- the stage ---------------------------------------------------------------------


def stage_optimizers(args, preset: str = "small", cases=CASES) -> dict:
  deadline = time.monotonic() + args.stage_seconds
  abstract = matrix_set(preset)
  shapes = matrix_shapes(abstract)
  rows = time_set(abstract, cases, deadline)
  theirs = reference.time_reference(shapes, deadline, STEPS, WARMUP)
  for r in theirs.get("rows", []):
    rows.append(rate_row(r["optimizer"], "microsoft/dion", r["seconds"], r["flops"]) if "seconds" in r
                else {**r, "implementation": "microsoft/dion"})
    print("  " + row_line(rows[-1]), flush=True)
  counts = {f"{m}x{n}": shapes.count((m, n)) for m, n in sorted(set(shapes))}
  record = {"set": {"preset": preset, "matrices": len(shapes), "shapes": counts, "rows": add_muon_ratio(rows),
                    "reference": theirs.get("skipped", theirs.get("what")),
                    "timing": f"mean of {STEPS} chained steps after {WARMUP} warm-up steps, ms"}}
  sweep_rows, complete = sweep(args.max_size, deadline)
  record.update(rows=sweep_rows, unit="ms per step", complete=complete)
  print(markdown(record), flush=True)
  return record


def markdown(record: dict) -> str:
  """The stage's tables: the set's optimizers side by side, then the sweep."""
  small = record["set"]
  ours = {r["optimizer"]: r for r in small["rows"] if r["implementation"] == "dion_jax"}
  theirs = {r["optimizer"]: r for r in small["rows"] if r["implementation"] == "microsoft/dion"}

  def cells(row: dict | None) -> list[str]:
    if row is None:
      return ["", "", "", ""]
    if "error" in row:
      return [row["error"][:80], "", "", ""]
    ratio = "" if row.get("vs_muon") is None else f"{row['vs_muon']:.2f}x"
    return [f"{row['ms']:.2f}", f"{row['gflop']:,.1f}", f"{row['tflops']:.1f}", ratio]

  counts = ", ".join(f"{n} x {shape}" for shape, n in small["shapes"].items())
  lines = [f"{small['preset']}'s {small['matrices']} matrices ({counts}), float32, update + apply; {small['timing']}",
           "",
           "| optimizer | ms | GFLOP | TFLOP/s | / Muon | microsoft/dion ms | GFLOP | TFLOP/s | / its Muon |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for name in dict.fromkeys([*ours, *theirs]):
    lines.append(f"| {name} | " + " | ".join(cells(ours.get(name)) + cells(theirs.get(name))) + " |")
  lines += ["", f"microsoft/dion: {small['reference']}"]
  if record.get("rows"):
    names = [n for n in sweep_optimizers() if any(n in r for r in record["rows"])]
    lines += ["", "One n x n float32 matrix, median ms of 9 steps after 2 warm-up steps:", "",
              "| n | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
    for row in record["rows"]:
      lines.append(f"| {row['n']} | " + " | ".join(
          f"{row[n]:.2f}" if isinstance(row.get(n), float) else str(row.get(n, "")) for n in names) + " |")
  return "\n".join(lines)
