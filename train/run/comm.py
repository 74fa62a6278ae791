"""What one training step sends, read from the step ``train.run.setup.setup`` compiles.

    communication over fs: 1.87 MB payload, 1.33 MB on the wire per device and step
    communication over rp: 86.83 kB payload, 86.83 kB on the wire per device and step
    dion's replica sync over rp=2: P and R averaged: 4 x 64x64 at rank 16; P and R averaged: 2 x 256x64 at rank 16

Bytes are ``dion_jax.accounting``'s: per device and step, each collective counted once
per run of its loop (a layer scan's once per layer), grouped by the mesh axes its
devices differ along; payload is operand bytes (output bytes for an all-gather), wire
what a ring algorithm sends. For Dion with per-replica gradients, each group of its
matrices (one shape and rank) either averages P and R over rp (compressed: (m + n)·r <
m·n, ``dion_jax.optimizers.dion``) or averages the gradient, which at full rank it must.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

import dion_jax
from train.run import optim
from train.run.config import Config


def traffic(compiled: Any, mesh: jax.sharding.Mesh) -> dict[str, dict[str, int]]:
  """``{"rp": {"payload": B, "wire": B}, "rp,fs": ...}``: bytes per device and step over
  each group of mesh axes (groups of one device, which send nothing, left out). A loop
  whose trip count XLA does not know counts once (``"loops_counted_once"``)."""
  try:
    stats, counted = dion_jax.collective_stats(compiled, mesh, trip_counts=True), True
  except ValueError:
    stats, counted = dion_jax.collective_stats(compiled, mesh), False
  payload, wire = (dion_jax.bytes_by_axes(stats, field) for field in ("bytes", "wire_bytes"))
  out = {",".join(axes): {"payload": payload[axes], "wire": wire[axes]} for axes in payload if axes}
  return out if counted else {**out, "loops_counted_once": True}


def replica_sync(cfg: Config, params: Any, specs: Any, mesh: jax.sharding.Mesh) -> list[dict] | None:
  """Per group of Dion matrices (one shape and rank): whether its replicas average P and R
  (``compressed``) or the gradient; None where Dion keeps no per-replica gradients."""
  if cfg.optimizer != "dion" or not cfg.dion_replicate_sync or dict(mesh.shape)["rp"] == 1:
    return None
  groups: dict[tuple, dict] = {}
  rank = optim.rank_fraction(cfg, params)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, p), spec, label in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                                    jax.tree.leaves(dion_jax.default_labels(params))):
    if label != "dion":
      continue
    path = jax.tree_util.keystr(path)
    fr = dion_jax.matrix_frame(p.shape, dion_jax.DionDimensionNumbers(), rank, 1, spec, path)
    key = (fr.rows, fr.cols, fr.rank)
    group = groups.setdefault(key, {"rows": fr.rows, "cols": fr.cols, "rank": fr.rank,
                                    "compressed": fr.compressible,
                                    "parameters": []})
    group["parameters"].append(path)
  return list(groups.values())


def describe(compiled: Any, mesh: jax.sharding.Mesh, cfg: Config, params: Any, specs: Any) -> dict:
  """The record ``config.json`` keeps under ``"communication"``."""
  return {"bytes_per_device_and_step": traffic(compiled, mesh),
          "dion_replica_sync": replica_sync(cfg, params, specs, mesh)}


def lines(record: dict, mesh: jax.sharding.Mesh) -> list[str]:
  """The log lines of :func:`describe`'s record: one per group of mesh axes, then Dion's
  replica sync."""
  by_axes = dict(record["bytes_per_device_and_step"])
  once = by_axes.pop("loops_counted_once", False)
  out = [f"communication over {axes}: {_size(b['payload'])} payload, {_size(b['wire'])} on the wire per device"
         " and step" + (" (loop bodies counted once)" if once else "")
         for axes, b in sorted(by_axes.items(), key=lambda kv: -kv[1]["wire"])]
  if not by_axes:
    out.append("communication: none (one device)")
  groups = record["dion_replica_sync"]
  if groups:
    def names(g):
      return f"{len(g['parameters'])} x {g['rows']}x{g['cols']} at rank {g['rank']}"
    sync = [("P and R averaged" if g["compressed"] else "gradient averaged ((m + n)·r >= m·n)") + f": {names(g)}"
            for g in groups]
    out.append(f"dion's replica sync over rp={dict(mesh.shape)['rp']}: " + "; ".join(sync))
  return out


def _size(n: int) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"
