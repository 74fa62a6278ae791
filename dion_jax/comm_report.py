"""Bytes moved by one Dion step on a mesh, measured from the compiled HLO.

``python -m dion_jax.comm_report --mesh rp=2,fs=2,tp=2`` compiles one
``scale_by_dion`` update for the matrices of a GPT (abstract arrays: nothing is
allocated), counts every collective with :mod:`dion_jax.comms`, and prints, per
rank fraction, the bytes per device over each set of mesh axes (P and R are
reduced over ``rp`` jointly with ``fs`` or ``tp``: the row "with rp" sums every
collective that crosses replicas), next to two baselines:

- the gradient all-reduce over ``rp`` that a data-parallel optimizer without
  compressed sync would do (compiled and measured the same way);
- ``Σ m·n·4``: the payload of an all-reduce of the full float32 gradient.

It also prints the optimizer-state bytes per device against one device.
"""

import argparse
import math
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dion_jax import comms
from dion_jax import transform
from dion_jax import mesh as mesh_lib
from dion_jax import sharded


class MatrixSet(NamedTuple):
  """Abstract Dion matrices: shapes and PartitionSpecs by name."""

  shapes: dict[str, tuple[int, ...]]
  specs: dict[str, P]


def gpt_matrices(layers: int = 12, d_model: int = 768, mlp_ratio: int = 4) -> MatrixSet:
  """The Dion matrices of a GPT, stacked over layers (Flax layout, layers on ``pp``)."""
  d, f = d_model, mlp_ratio * d_model
  col, row = mesh_lib.column_parallel(), mesh_lib.row_parallel()
  kernels = {"qkv": ((d, 3 * d), col), "attn_out": ((d, d), row), "fc1": ((d, f), col), "fc2": ((f, d), row)}
  return MatrixSet(
      {k: (layers,) + s for k, (s, _) in kernels.items()},
      {k: mesh_lib.stacked(spec) for k, (_, spec) in kernels.items()},
  )


def _abstract(shape, spec, mesh, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _frames(mats: MatrixSet, rank_fraction: float) -> dict:
  names = sorted(mats.shapes)
  structs = {k: jax.ShapeDtypeStruct(mats.shapes[k], jnp.float32) for k in names}
  frames = transform.leaf_frames(structs, rank_fraction=rank_fraction, rank_multiple_of=1, partition_specs=mats.specs)
  return dict(zip(names, frames))


def _abstract_inputs(layout: sharded.Layout, mats: MatrixSet, rank_fraction: float):
  """Abstract (gradients, state) of one sharded Dion update, with their shardings."""
  mesh = layout.mesh
  frames = _frames(mats, rank_fraction)
  grads = {
      k: _abstract(((layout.replicas,) if layout.per_replica else ()) + fr.shape, layout.grad_spec(fr), mesh)
      for k, fr in frames.items()
  }  # fmt: skip
  state = transform.ScaleByDionState(
      count=_abstract((), P(), mesh, jnp.int32),
      momentum={
          k: _abstract(((layout.replicas,) if layout.compressed(fr) else ()) + fr.shape, layout.momentum_spec(fr), mesh)
          for k, fr in frames.items()
      },  # fmt: skip
      q={k: _abstract(fr.q_shape, layout.q_spec(fr), mesh) for k, fr in frames.items()},
  )
  return grads, state


def dion_step_stats(
    mesh: jax.sharding.Mesh, mats: MatrixSet, rank_fraction: float, replicate_sync: bool = True
) -> list[comms.CollectiveStat]:
  """Collectives of one compiled Dion update of ``mats`` on ``mesh``."""
  tx = transform.scale_by_dion(
      rank_fraction=rank_fraction, partition_specs=mats.specs, mesh=mesh,
      replicate_sync=replicate_sync, backend="xla",
  )  # fmt: skip
  layout = sharded.Layout(mesh, replicate_sync)
  grads, state = _abstract_inputs(layout, mats, rank_fraction)
  return comms.collective_stats(jax.jit(tx.update).lower(grads, state).compile(), mesh)


def gradient_allreduce_stats(mesh: jax.sharding.Mesh, mats: MatrixSet) -> list[comms.CollectiveStat]:
  """Collectives of averaging per-replica gradients of ``mats`` over ``rp``."""
  grads = {k: _abstract((mesh.shape["rp"],) + s, P("rp", *mats.specs[k]), mesh) for k, s in mats.shapes.items()}
  out = {k: NamedSharding(mesh, spec) for k, spec in mats.specs.items()}
  mean = jax.jit(lambda g: jax.tree.map(lambda x: x.mean(0), g), out_shardings=out)
  return comms.collective_stats(mean.lower(grads).compile(), mesh)


def full_gradient_bytes(mats: MatrixSet) -> int:
  """``Σ m·n·4``: the float32 payload of an all-reduce of every full gradient."""
  return sum(4 * math.prod(s) for s in mats.shapes.values())


def state_bytes_per_device(mesh: jax.sharding.Mesh, mats: MatrixSet, rank_fraction: float) -> tuple[int, int]:
  """(bytes of Dion's M and Q held by one device of ``mesh``, bytes of M and Q on one device alone)."""
  _, state = _abstract_inputs(sharded.Layout(mesh, replicate_sync=True), mats, rank_fraction)
  local = sum(4 * math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves((state.momentum, state.q)))
  single = sum(4 * (math.prod(fr.shape) + math.prod(fr.q_shape)) for fr in _frames(mats, rank_fraction).values())
  return local, single


def _sum_by_axes(stats, field: str) -> dict[tuple[str, ...], int]:
  out: dict[tuple[str, ...], int] = {}
  for s in stats:
    out[s.axes] = out.get(s.axes, 0) + getattr(s, field)
  return out


def _report(mesh, mats, rank_fractions) -> str:
  full = full_gradient_bytes(mats)
  dp = mesh.shape["rp"] * mesh.shape["fs"]
  full_wire = 2 * full * (dp - 1) // dp
  base = sum(s.bytes for s in gradient_allreduce_stats(mesh, mats)) if mesh.shape["rp"] > 1 else 0
  lines = [
      f"mesh {dict(mesh.shape)}. Baselines per device: full-gradient payload Σm·n·4 = {full / 2**20:.2f} MiB"
      f" (a ring all-reduce over the rp·fs = {dp} data-parallel devices sends {full_wire / 2**20:.2f} MiB);"
      f" averaging this device's gradient shard over rp = {base / 2**20:.2f} MiB.",
      "Payload: operand bytes (output for all-gather). Wire: bytes sent under ring algorithms"
      " (all-reduce 2(g-1)/g, reduce-scatter and all-gather (g-1)/g of the payload).",
      "",
      "| rank_fraction | axes | payload MiB | wire MiB | payload / Σm·n·4 | wire / full-gradient ring all-reduce |",
      "| --- | --- | --- | --- | --- | --- |",
  ]
  for rf in rank_fractions:
    stats = dion_step_stats(mesh, mats, rf)
    payload, wire = _sum_by_axes(stats, "bytes"), _sum_by_axes(stats, "wire_bytes")
    rows = [(",".join(axes) or "-", lambda a, axes=axes: a == axes) for axes in sorted(payload)]
    rows += [("with rp", lambda a: "rp" in a), ("all", lambda a: True)]
    for label, keep in rows:
      p = sum(v for a, v in payload.items() if keep(a))
      w = sum(v for a, v in wire.items() if keep(a))
      wire_ratio = f"{w / full_wire:.3f}x" if full_wire else ""
      lines.append(f"| {rf:g} | {label} | {p / 2**20:.3f} | {w / 2**20:.3f} | {p / full:.3f}x | {wire_ratio} |")
  lines += ["", "| rank_fraction | M+Q bytes/device | M+Q bytes on one device | ratio |", "| --- | --- | --- | --- |"]
  for rf in rank_fractions:
    local, single = state_bytes_per_device(mesh, mats, rf)
    lines.append(f"| {rf:g} | {local / 2**20:.2f} MiB | {single / 2**20:.2f} MiB | {local / single:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m dion_jax.comm_report",
      description="Compile one Dion step for a GPT's matrices on a mesh and report the bytes of every "
      "collective by mesh axes (from the compiled HLO), against a gradient all-reduce.",
  )
  parser.add_argument(
      "--optimizer", default="dion", choices=("dion", "dion2", "normuon", "muon"),
      help="dion (default), or dion2/normuon/muon beside Dion at rank 1/4",
  )  # fmt: skip
  parser.add_argument("--mesh", default="rp=2,fs=2,tp=2", help="mesh spec, e.g. rp=2,fs=2,tp=2 (default)")
  parser.add_argument("--layers", type=int, default=12, help="transformer layers (default 12: GPT-124M)")
  parser.add_argument("--d-model", type=int, default=768, help="model width (default 768)")
  parser.add_argument(
      "--rank-fractions", default="1,0.5,0.25,0.0625", help="comma-separated rank fractions (default 1,0.5,0.25,0.0625)"
  )
  args = parser.parse_args(argv)
  try:
    sizes = mesh_lib.parse_mesh_spec(args.mesh)
    n = math.prod(sizes.values())
    try:
      jax.config.update("jax_num_cpu_devices", n)  # Fake CPU devices; no effect on GPUs.
    except RuntimeError:
      pass  # The backend already started (e.g. called from Python): use its devices.
    mesh = mesh_lib.make_mesh(sizes, jax.devices()[:n])
    mats = gpt_matrices(args.layers, args.d_model)
    structs = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in mats.shapes.items()}
    mesh_lib.tree_check_divisible(structs, mats.specs, mesh)
    rank_fractions = [float(x) for x in args.rank_fractions.split(",")]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.optimizer == "dion":
    print(_report(mesh, mats, rank_fractions))
  else:
    from dion_jax import family_comm  # It builds on this module.

    print(family_comm.report(mesh, mats, args.optimizer))
  return 0


if __name__ == "__main__":
  sys.exit(main())
