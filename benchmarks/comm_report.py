"""Bytes moved by one optimizer step on a mesh, measured from the compiled HLO.

    python -m benchmarks.comm_report --mesh rp=2,fs=2,tp=2
    python -m benchmarks.comm_report --optimizer muon --mesh fs=4,tp=2 --layers 8 --d-model 256
    python -m benchmarks.comm_report --num-experts 8 --mesh rp=2,fs=2,ep=2 --layers 4 --d-model 256

Compiles one update of the matrix transformation (``scale_by_dion``, or
``scale_by_orthogonal`` for dion2/nordion2/normuon/muon) for the Dion-labelled matrices of a
GPT (abstract arrays: nothing is allocated), counts every collective with
``dion_jax.accounting``, and prints the bytes per device over each set of mesh axes
next to two baselines:

- ``Σ m·n·4``: the payload of an all-reduce of the full float32 gradient, and the
  bytes a ring all-reduce of it over the rp·fs·ep·cp data-parallel devices sends (an
  upper bound with experts, whose gradients reduce over rp·fs only);
- the gradient all-reduce over ``rp`` that a data-parallel optimizer without
  compressed sync would do (compiled and measured the same way).

For Dion it also prints, per rank fraction, the optimizer-state bytes per device
against one device. ``--matrices gpt`` (default) takes the repository's GPT
(``models``: separate query, key and value); ``--matrices gpt124m-fused`` a GPT-124M
shape set with a fused qkv kernel, which the figures before the package's redesign
used.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dion_jax
import models
from benchmarks import harness
from dion_jax import accounting

OPTIMIZERS = ("dion", "dion2", "nordion2", "normuon", "muon")


def gpt_matrices(layers: int, d_model: int, pp: int, num_experts: int = 0) -> tuple[dict, dict]:
  """(shapes, specs) by path of the repository GPT's Dion-labelled kernels (with
  ``num_experts``, its MoE's router and expert stacks instead of the MLP's)."""
  cfg = models.preset("small", num_layers=layers, d_model=d_model, num_heads=max(1, d_model // 64),
                      num_experts=num_experts)

  def create():
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0))))
    params["blocks"] = models.to_stages(params["blocks"], pp)
    return params

  params = jax.eval_shape(create)
  specs, labels = models.param_specs(params), dion_jax.default_labels(params)
  shapes, by_path = {}, {}
  for (path, leaf), spec, label in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                       jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                                       jax.tree.leaves(labels)):
    if label == "dion":
      name = jax.tree_util.keystr(path)
      shapes[name], by_path[name] = leaf.shape, spec
  return shapes, by_path


def gpt124m_fused_matrices(layers: int, d_model: int) -> tuple[dict, dict]:
  """(shapes, specs) of a GPT-124M-like set with a fused qkv kernel, stacked over layers."""
  d, f = d_model, 4 * d_model
  col, row = dion_jax.column_parallel(), dion_jax.row_parallel()
  kernels = {"qkv": ((d, 3 * d), col), "attn_out": ((d, d), row), "fc1": ((d, f), col), "fc2": ((f, d), row)}
  return ({k: (layers,) + s for k, (s, _) in kernels.items()},
          {k: dion_jax.stacked(spec) for k, (_, spec) in kernels.items()})


def gradient_allreduce_stats(mesh, shapes, specs) -> list[dion_jax.CollectiveStat]:
  """Collectives of averaging per-replica gradients over ``rp``."""
  grads = {k: jax.ShapeDtypeStruct((mesh.shape["rp"],) + s, jnp.float32,
                                   sharding=NamedSharding(mesh, P("rp", *specs[k]))) for k, s in shapes.items()}
  out = {k: NamedSharding(mesh, spec) for k, spec in specs.items()}
  mean = jax.jit(lambda g: jax.tree.map(lambda x: x.mean(0), g), out_shardings=out)
  return dion_jax.collective_stats(mean.lower(grads).compile(), mesh)


def transformation(optimizer: str, mesh, specs, rank_fraction: float = 0.25, **kwargs):
  if optimizer == "dion":
    return dion_jax.scale_by_dion(rank_fraction=rank_fraction, partition_specs=specs, mesh=mesh, backend="xla")
  # The family orthogonalizes the replicas' mean gradient, as training runs it (train/run/optim.py):
  # no per-replica gradients.
  return dion_jax.scale_by_orthogonal(optimizer, partition_specs=specs, mesh=mesh, backend="xla",
                                      replicate_sync=False, **kwargs)


def _table(rows: dict[str, list], full: int, full_wire: int, label: str) -> list[str]:
  lines = [f"| {label} | axes | payload MiB | wire MiB | payload / Σm·n·4 | wire / full-gradient ring all-reduce |",
           "| --- | --- | --- | --- | --- | --- |"]
  for name, stats in rows.items():
    payload = accounting.bytes_by_axes(stats)
    wire = accounting.bytes_by_axes(stats, "wire_bytes")
    groups = [(",".join(axes) or "-", lambda a, axes=axes: a == axes) for axes in sorted(payload)]
    groups += [("with rp", lambda a: "rp" in a)] if any("rp" in a for a in payload) else []
    for axes_label, keep in groups + [("all", lambda a: True)]:
      p = sum(v for a, v in payload.items() if keep(a))
      w = sum(v for a, v in wire.items() if keep(a))
      ratio = f"{w / full_wire:.3f}x" if full_wire else ""
      lines.append(f"| {name} | {axes_label} | {p / 2**20:.3f} | {w / 2**20:.3f} | {p / full:.3f}x | {ratio} |")
  return lines


def report(mesh, shapes, specs, optimizer: str, rank_fractions: list[float],
           say: Callable[[str], None] = lambda _: None) -> str:
  """The report's text; ``say`` hears which update is being compiled (each takes a while)."""
  params = accounting.abstract_params(shapes, specs, mesh)
  per_replica = mesh.shape["rp"] > 1
  full = accounting.full_gradient_bytes(params)
  dp = mesh.shape["rp"] * mesh.shape["fs"] * mesh.shape["ep"] * mesh.shape["cp"]
  full_wire = accounting.ring_allreduce_bytes(full, dp)
  base = sum(s.bytes for s in gradient_allreduce_stats(mesh, shapes, specs)) if per_replica else 0
  lines = [
      f"mesh {dict(mesh.shape)}. Baselines per device: full-gradient payload Σm·n·4 = {full / 2**20:.2f} MiB"
      f" (a ring all-reduce over the rp·fs·ep·cp = {dp} data-parallel devices sends {full_wire / 2**20:.2f} MiB);"
      f" averaging this device's gradient shard over rp = {base / 2**20:.2f} MiB.",
      "Payload: operand bytes (output for all-gather). Wire: bytes sent under ring algorithms"
      " (all-reduce 2(g-1)/g, reduce-scatter and all-gather (g-1)/g of the payload).",
      "",
  ]
  if optimizer == "dion":
    rows = {}
    for i, rf in enumerate(rank_fractions):
      say(f"compiling Dion's update at rank fraction {rf:g} ({i + 1}/{len(rank_fractions)})")
      rows[f"{rf:g}"] = accounting.update_stats(transformation("dion", mesh, specs, rf), params, mesh, per_replica)
    lines += _table(rows, full, full_wire, "rank_fraction")
    lines += ["", "| rank_fraction | state bytes/device | state bytes on one device | ratio |",
              "| --- | --- | --- | --- |"]
    for rf in rank_fractions:
      local, _ = accounting.state_bytes(accounting.abstract_state(transformation("dion", mesh, specs, rf), params))
      _, single = accounting.state_bytes(jax.eval_shape(transformation("dion", None, specs, rf).init, params))
      lines.append(f"| {rf:g} | {local / 2**20:.2f} MiB | {single / 2**20:.2f} MiB | {local / single:.3f} |")
    return "\n".join(lines)
  tx = lambda **kw: transformation(optimizer, mesh, specs, **kw)  # noqa: E731
  if optimizer in ("dion2", "nordion2"):
    rows = {}
    for scope in ("local", "global"):
      say(f"compiling {optimizer}'s update ({scope} selection)")
      rows[f"{optimizer} (fraction 0.25, {scope})"] = accounting.update_stats(
          tx(fraction=0.25, selection_scope=scope), params, mesh)
  else:
    say(f"compiling {optimizer}'s update")
    rows = {optimizer: accounting.update_stats(tx(), params, mesh)}
  say("compiling Dion's update at rank fraction 1/4, for comparison")
  rows["dion (rank 1/4)"] = accounting.update_stats(transformation("dion", mesh, specs), params, mesh, per_replica)
  return "\n".join(lines + _table(rows, full, full_wire, "optimizer"))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.comm_report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--optimizer", default="dion", choices=OPTIMIZERS,
                      help="dion (default: per rank fraction), or dion2/nordion2/normuon/muon beside Dion at rank 1/4")
  parser.add_argument("--mesh", default="rp=2,fs=2,tp=2", help="mesh spec (default rp=2,fs=2,tp=2)")
  parser.add_argument("--matrices", default="gpt", choices=("gpt", "gpt124m-fused"),
                      help="the repository's GPT (default) or GPT-124M shapes with a fused qkv")
  parser.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
  parser.add_argument("--d-model", type=int, default=768, help="model width (default 768)")
  parser.add_argument("--num-experts", type=int, default=0,
                      help="--matrices gpt: a mixture of this many experts per layer (default 0: dense);"
                           " experts split over the mesh's ep")
  parser.add_argument("--rank-fractions", default="1,0.5,0.25,0.0625",
                      help="Dion's rank fractions, comma-separated (default 1,0.5,0.25,0.0625)")
  args = parser.parse_args(argv)
  try:
    sizes = dion_jax.parse_mesh_spec(args.mesh)
    try:
      harness.setup_process(cpu_devices=math.prod(sizes.values()))
    except RuntimeError:
      pass  # The backend already started (e.g. called from Python): use its devices.
    mesh = harness.mesh(args.mesh)
    if args.matrices == "gpt":
      shapes, specs = gpt_matrices(args.layers, args.d_model, sizes["pp"], args.num_experts)
    else:
      shapes, specs = gpt124m_fused_matrices(args.layers, args.d_model)
    dion_jax.tree_check_divisible({k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}, specs, mesh)
    rank_fractions = [float(x) for x in args.rank_fractions.split(",")]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(report(mesh, shapes, specs, args.optimizer, rank_fractions,
               say=lambda what: print(what, file=sys.stderr, flush=True)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
