"""Context parallelism: per-device memory, collective bytes and speed, against the formulas.

    python -m benchmarks.context_memory                       # all three stages
    python -m benchmarks.context_memory --stage memory --seq-lens 2048 4096

Stages (fake CPU devices; everything compiled from abstract arrays except ``speed``):

- ``memory``: the compiled gradient step of ``--preset`` (default small) on one sequence,
  per device: arguments (the parameters, sharded over cp as over fs), outputs (their
  gradients, sharded likewise) and temporaries, from ``compiled.memory_analysis()``, at
  each sequence length and cp. Formula for the
  temporaries (float32, only matrix products saved for the backward pass):
  ``L·B·(T/cp)·(N·T + c·D)·4`` bytes: the saved (T/cp × T) scores of every layer, plus c
  activations of width D per token and layer (c is read off the measurement).
- ``comm``: the collectives of the step over cp, per layer (the layer scan's body counts
  once), for the all-gather scheme of ``models/context.py`` and for a ring prototype
  (:func:`ring_attention`, K/V passed by ppermute with an online softmax, differentiated
  by autodiff), against the formula: forward, each scheme moves K and V,
  ``2·B·T·D·4·(cp − 1)/cp`` bytes sent per device.
- ``speed``: tokens/s of the gradient step on a long sequence at cp = 1, cp = 2 (all-gather)
  and cp = 2 (ring), interleaved rounds.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import dion_jax
import models
from benchmarks import harness
from models import context
from train.gpu import timing


def ring_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, *, implementation, cp, segment_ids_BxT=None):
  """The ring scheme, for comparison: cp steps, each attending this rank's queries to one
  rank's K/V block (online softmax), then passing the block on by ppermute."""
  del implementation, segment_ids_BxT
  if cp == 1:
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, is_causal=True)
  B, Tl, N, H = q_BxTxNxH.shape
  T = Tl * cp
  order = jnp.asarray(context.token_order(T, cp), jnp.int32)
  me = jax.lax.axis_index(context.AXIS)
  pos_q = context.positions(T, cp)
  ring = [(i, (i + 1) % cp) for i in range(cp)]
  m = jnp.full((B, N, Tl), -jnp.inf, jnp.float32)
  l = jnp.zeros((B, N, Tl), jnp.float32)
  acc = jnp.zeros((B, N, Tl, H), jnp.float32)
  k, v = k_BxTxNxH, v_BxTxNxH
  for step in range(cp):  # unrolled: every ppermute shows in the HLO
    pos_k = jax.lax.dynamic_slice_in_dim(order, ((me - step) % cp) * Tl, Tl)
    s = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k) / math.sqrt(H)
    s = jnp.where(pos_q[:, None] >= pos_k[None, :], s, -1e30)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(-1)
    acc = acc * correction[..., None] + jnp.einsum("bnts,bsnh->bnth", p, v)
    m = m_new
    if step < cp - 1:
      k, v = (jax.lax.ppermute(t, context.AXIS, ring) for t in (k, v))
  return (acc / l[..., None]).transpose(0, 2, 1, 3).astype(q_BxTxNxH.dtype)


def abstract_params(cfg: models.GPTConfig, mesh: jax.sharding.Mesh):
  """(graphdef, params as ShapeDtypeStructs with their shardings): nothing allocated."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))))

  def create():
    params = nnx.to_pure_dict(nnx.state(models.GPT(cfg, rngs=nnx.Rngs(0))))
    return {**params, "blocks": models.to_stages(params["blocks"], 1)}

  shapes = jax.eval_shape(create)
  specs = models.param_specs(shapes)
  return graphdef, jax.tree.map(
      lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
      shapes, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _grad_fn(graphdef, par):
  return jax.jit(jax.value_and_grad(lambda p, b: models.loss(graphdef, p, b, par)))


def compiled_step(cfg: models.GPTConfig, cp: int, batch: int, scheme: str = "all-gather"):
  mesh = harness.mesh(f"cp={cp}")
  par = models.Parallelism(mesh)
  graphdef, params = abstract_params(cfg, mesh)
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
  with _scheme(scheme), jax.set_mesh(mesh):
    return mesh, _grad_fn(graphdef, par).lower(params, {"inputs": tokens, "targets": tokens}).compile()


class _scheme:
  """Within the block, ``models.gpt`` attends by ``scheme``."""

  def __init__(self, scheme: str):
    self.fn = {"all-gather": context.attention, "ring": ring_attention}[scheme]

  def __enter__(self):
    self.saved, context.attention = context.attention, self.fn

  def __exit__(self, *exc):
    context.attention = self.saved


def memory(args) -> None:
  print(f"## per-device memory, {args.preset}, batch {args.batch}, float32 (MiB)")
  print("| T | cp | arguments | outputs | temporaries | total | scores L·B·N·(T/cp)·T·4"
        " | rest / (L·B·(T/cp)·D·4) = c |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for T in args.seq_lens:
    for cp in args.cps:
      cfg = models.preset(args.preset, seq_len=T)
      _, compiled = compiled_step(cfg, cp, args.batch)
      mem = compiled.memory_analysis()
      L, N, D, B = cfg.num_layers, cfg.num_heads, cfg.d_model, args.batch
      scores = L * B * N * (T // cp) * T * 4
      c = (mem.temp_size_in_bytes - scores) / (L * B * (T // cp) * D * 4)
      mib = 2**20
      sizes = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes)
      print(f"| {T} | {cp} | {' | '.join(f'{x / mib:.0f}' for x in (*sizes, sum(sizes)))}"
            f" | {scores / mib:.0f} | {c:.1f} |", flush=True)


def comm(args) -> None:
  T, B = args.comm_seq_len, args.batch
  cfg = models.preset(args.preset, seq_len=T)
  D = cfg.d_model
  print(f"\n## collectives over cp per layer, {args.preset}, T {T}, batch {B} (MiB per device)")
  print("| scheme | cp | op | count | payload | sent (ring algorithms) | formula: K,V forward sent |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for cp in args.cps:
    if cp == 1:
      continue
    for scheme in ("all-gather", "ring"):
      mesh, compiled = compiled_step(cfg, cp, B, scheme)
      mem = compiled.memory_analysis()
      formula = 2 * B * T * D * 4 * (cp - 1) / cp / 2**20
      for s in dion_jax.collective_stats(compiled, mesh):
        if s.axes == ("cp",):
          print(f"| {scheme} | {cp} | {s.op} | {s.count} | {s.bytes / 2**20:.1f} | {s.wire_bytes / 2**20:.1f}"
                f" | {formula:.1f} |")
      print(f"| {scheme} | {cp} | memory: temporaries | | {mem.temp_size_in_bytes / 2**20:.0f} | | |",
            flush=True)


def speed(args) -> None:
  cfg = models.preset("tiny", seq_len=args.speed_seq_len)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, cfg.seq_len + 1))
  batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
  cases = {}
  for name, cp, scheme in (("cp=1", 1, "all-gather"), ("cp=2 all-gather", 2, "all-gather"), ("cp=2 ring", 2, "ring")):
    mesh = harness.mesh(f"cp={cp}")
    par = models.Parallelism(mesh)
    graphdef, params = models.init(cfg, par)
    with _scheme(scheme), jax.set_mesh(mesh):
      compiled = _grad_fn(graphdef, par).lower(params, batch).compile()
    cases[name] = (compiled, (params, batch))
  times = timing.interleaved_times(cases, rounds=args.rounds, repeats=1)
  print(f"\n## gradient step, tiny, one sequence of {cfg.seq_len} tokens, {jax.device_count()} CPU devices")
  print("| case | s/step | tokens/s |\n| --- | --- | --- |")
  for name, t in times.items():
    print(f"| {name} | {t:.3f} | {cfg.seq_len / t:.0f} |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.context_memory", description=__doc__.split("\n")[0])
  parser.add_argument("--stage", choices=("memory", "comm", "speed", "all"), default="all")
  parser.add_argument("--preset", default="small")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
  parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--comm-seq-len", type=int, default=4096)
  parser.add_argument("--speed-seq-len", type=int, default=4096)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  harness.setup_process(cpu_devices=max(args.cps), platform="cpu")
  stages = {"memory": memory, "comm": comm, "speed": speed}
  for name, stage in stages.items():
    if args.stage in (name, "all"):
      stage(args)


if __name__ == "__main__":
  main()
