"""Optimizer-step time of Dion2, NorDion2, NorMuon and our Muon against optax's Muon and Dion, one CPU device.

    python -m benchmarks.family_step --layers 6 --d-model 512 --rounds 5

The GPT matrices of ``harness.gpt_matrices`` (per layer qkv, out, fc1, fc2 as Flax
kernels stacked over layers; ``--split-qkv``: query, key and value apart, as
``models/gpt.py`` has them, so that ours orthogonalize them with out as one
megabatch), every optimizer jitted, timed in interleaved rounds (median over rounds of
the median of ``--repeats`` calls; this VM's speed drifts by ±10%), and reported as a
ratio to ``optax.contrib.muon``. Ours run their default bf16 Polar Express; Muon also
with the Gram steps and with the rescaled four-step Newton–Schulz; ``--float32`` adds
float32 rows (optax's Muon iterates in float32 with its Newton–Schulz coefficients).
Dion runs at rank 1/4 with RCQR, Dion2 and NorDion2 at fraction 1/4.
"""

import jax.numpy as jnp
import optax

import dion_jax
from benchmarks import harness
from train.gpu import timing


def optimizers(float32: bool) -> dict:
  labels = {"labels": lambda params: {k: "dion" for k in params}}
  out = {
      "optax.contrib.muon": optax.contrib.muon(
          0.01, muon_weight_dimension_numbers=optax.contrib.MuonDimensionNumbers(-2, -1)
      ),
      "dion (rank 1/4)": dion_jax.dion(0.01, rank_fraction=0.25, **labels),
      "dion2 (fraction 1/4)": dion_jax.dion2(0.01, fraction=0.25, **labels),
      "nordion2 (fraction 1/4)": dion_jax.nordion2(0.01, fraction=0.25, **labels),
      "normuon": dion_jax.normuon(0.01, **labels),
      "muon": dion_jax.muon(0.01, **labels),
      "muon, gram_newton_schulz": dion_jax.muon(0.01, gram_newton_schulz=True, **labels),
      "muon, rescaled_newton_schulz": dion_jax.muon(0.01, ortho_method="rescaled_newton_schulz", **labels),
  }
  if float32:
    out["dion2 (fraction 1/4), float32"] = dion_jax.dion2(0.01, ortho_dtype=jnp.float32, **labels)
    out["nordion2 (fraction 1/4), float32"] = dion_jax.nordion2(0.01, ortho_dtype=jnp.float32, **labels)
    out["normuon, float32"] = dion_jax.normuon(0.01, ortho_dtype=jnp.float32, **labels)
    out["muon, float32"] = dion_jax.muon(0.01, ortho_dtype=jnp.float32, **labels)
    out["muon, float32 newton_schulz"] = dion_jax.muon(
        0.01, ortho_dtype=jnp.float32, ortho_method="newton_schulz", **labels
    )
  return out


def main():
  parser = harness.matrix_benchmark_parser("family_step", __doc__.splitlines()[0], repeats=3)
  parser.add_argument("--float32", action="store_true", help="also time our optimizers in float32")
  parser.add_argument("--split-qkv", action="store_true", help="query, key and value as three kernels")
  args = parser.parse_args()
  harness.setup_process(platform="cpu")
  params = harness.gpt_matrices(args.layers, args.d_model, fused_qkv=not args.split_qkv)
  cases = {}
  for name, tx in optimizers(args.float32).items():
    step, step_args, _ = timing.jitted_step(tx, params)
    cases[name] = (step, step_args)
  times = timing.interleaved_times(cases, args.rounds, args.repeats)
  base = times["optax.contrib.muon"]
  qkv = "query, key, value apart" if args.split_qkv else "fused qkv"
  print(f"{args.layers} layers, d_model {args.d_model}, {qkv}, one CPU device; "
        f"median of {args.rounds} interleaved rounds")
  print("| optimizer | step ms | / optax.contrib.muon |")
  print("| --- | --- | --- |")
  for name, t in times.items():
    print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x |")


if __name__ == "__main__":
  main()
