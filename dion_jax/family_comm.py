"""Bytes moved by one Muon, NorMuon or Dion2 step on a mesh, from the compiled HLO.

The counterpart of ``dion_jax.comm_report`` for ``dion_jax.family``:
``python -m dion_jax.comm_report --optimizer muon`` prints, per set of mesh axes,
the bytes of every collective of one compiled ``scale_by_orthogonal`` update of a
GPT's matrices, beside Dion's (rank 1/4) and a full-gradient all-reduce's.

Expected payloads per device for one stacked parameter of B matrices (m x n) whose
local block is b = B·m·n/(N_fs·N_tp) values, ortho_dtype bf16 (2 bytes), B divisible
by the group: Muon and NorMuon move 4·2b bytes (two all-to-alls there, two back),
plus NorMuon's row and Frobenius norms (float32, (B, m) and (B,) values); Dion2 moves
about a ``fraction`` of that.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dion_jax import comm_report
from dion_jax import comms
from dion_jax import family
from dion_jax import sharded


def family_step_stats(
    mesh: jax.sharding.Mesh, mats: comm_report.MatrixSet, algorithm: str, **kwargs
) -> list[comms.CollectiveStat]:
  """Collectives of one compiled ``scale_by_orthogonal(algorithm, **kwargs)`` update."""
  tx = family.scale_by_orthogonal(algorithm, partition_specs=mats.specs, mesh=mesh, backend="xla", **kwargs)
  layout = sharded.Layout(mesh, replicate_sync=True, compress=False)
  rp = (layout.replicas,) if layout.per_replica else ()
  grads = {
      k: comm_report._abstract(rp + s, P(*(("rp",) if rp else ()), *mats.specs[k]), mesh)
      for k, s in mats.shapes.items()
  }  # fmt: skip
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in mats.shapes.items()}
  state = jax.eval_shape(tx.init, params)
  state = jax.tree.map(
      lambda x, spec: comm_report._abstract(x.shape, spec, mesh),
      state,
      family.ScaleByOrthogonalState(
          {k: P(*mats.specs[k]) for k in mats.shapes},
          {k: P(*mats.specs[k][:-2], None, mats.specs[k][-1]) for k in mats.shapes} if algorithm == "normuon" else (),
      ),
  )
  return comms.collective_stats(jax.jit(tx.update).lower(grads, state).compile(), mesh)


def report(mesh: jax.sharding.Mesh, mats: comm_report.MatrixSet, algorithm: str, fraction: float = 0.25) -> str:
  full = comm_report.full_gradient_bytes(mats)
  dp = mesh.shape["rp"] * mesh.shape["fs"]
  full_wire = 2 * full * (dp - 1) // dp
  kwargs = {"fraction": fraction} if algorithm == "dion2" else {}
  rows = {f"{algorithm}" + (f" (fraction {fraction:g}, local)" if algorithm == "dion2" else ""): family_step_stats(
      mesh, mats, algorithm, **kwargs)}  # fmt: skip
  if algorithm == "dion2":
    rows[f"dion2 (fraction {fraction:g}, global)"] = family_step_stats(
        mesh, mats, algorithm, selection_scope="global", **kwargs
    )
  rows["dion (rank 1/4)"] = comm_report.dion_step_stats(mesh, mats, 0.25)
  lines = [
      f"mesh {dict(mesh.shape)}. Full-gradient payload Σm·n·4 = {full / 2**20:.2f} MiB; a ring all-reduce over"
      f" the rp·fs = {dp} data-parallel devices sends {full_wire / 2**20:.2f} MiB per device.",
      "",
      "| optimizer | axes | payload MiB | wire MiB | payload / Σm·n·4 | wire / full-gradient ring all-reduce |",
      "| --- | --- | --- | --- | --- | --- |",
  ]
  for name, stats in rows.items():
    payload = comms.bytes_by_axes(stats)
    wire: dict = {}
    for s in stats:
      wire[s.axes] = wire.get(s.axes, 0) + s.wire_bytes
    for axes in sorted(payload) + ["all"]:
      p = sum(payload.values()) if axes == "all" else payload[axes]
      w = sum(wire.values()) if axes == "all" else wire[axes]
      label = axes if axes == "all" else (",".join(axes) or "-")
      ratio = f"{w / full_wire:.3f}x" if full_wire else ""
      lines.append(f"| {name} | {label} | {p / 2**20:.3f} | {w / 2**20:.3f} | {p / full:.3f}x | {ratio} |")
  return "\n".join(lines)
