"""Optimizer-step time of Dion against AdamW and Muon on the matrices of a GPT, one CPU device.

    python -m benchmarks.dion_step --layers 6 --d-model 512 --repeats 5

Parameters: per layer qkv (d, 3d), out (d, d), fc1 (d, 4d), fc2 (4d, d) as Flax kernels,
stacked over layers as (L, fan_in, fan_out); ``--split-qkv``: query, key and value apart,
which with out form one megabatch of Dion (``dion_jax.optimizers.skeleton``). Every optimizer step is jitted and timed as
the median over ``--rounds`` rounds of the median of ``--repeats`` calls, every case
(the plain matmul included) timed in every round, all in one process, and reported as
a ratio to Muon. Dion's achieved GFLOP/s counts 8·m·n·r per matrix (P = B Q, R = Bᵀ P,
P Rᵀ and P Qᵀ) plus the orthonormalization's: shifted Cholesky QR's 16·m·r² (four Grams
and four multiplications by R⁻¹), or RCQR's 2·k·m·r (sketch product) + 4·m·r² (two solves and a Gram),
and is set against a plain float32 matmul measured in the same run. The last columns
count the page faults and kernel CPU time of one step: the allocator maps each step's
fresh buffers anew, a cost the matmul baseline does not pay. ``--profile`` times the
pieces of one Dion step at one rank fraction.
"""

import resource
import sys

import jax
import jax.numpy as jnp
import optax

import dion_jax
from benchmarks import harness
from dion_jax.kernels import rcqr_xla, sketch
from dion_jax.linalg import qr
from train.gpu import timing


def kernel_cost_per_call(fn, args, calls: int = 5) -> tuple[float, float]:
  """Minor page faults and kernel (system) CPU seconds per call of ``fn(*args)``.

  A fault is a first touch of memory the allocator got fresh from the kernel, which
  zeroes it: output and temporary buffers of tens of MB are mapped anew on every
  call here (glibc maps blocks over 32 MB directly, and trims freed ones), and the
  step's wall time includes that work.
  """
  before = resource.getrusage(resource.RUSAGE_SELF)
  for _ in range(calls):
    jax.block_until_ready(fn(*args))
  after = resource.getrusage(resource.RUSAGE_SELF)
  return (after.ru_minflt - before.ru_minflt) / calls, (after.ru_stime - before.ru_stime) / calls


def dion_flops(params, rank_fraction: float, qr_method: str = "shifted_cqr", oversample: float = 1.25) -> float:
  total = 0.0
  for p in params.values():
    L, fan_in, fan_out = p.shape
    rows, cols = max(fan_in, fan_out), min(fan_in, fan_out)
    r = dion_jax.dion_rank(rank_fraction, 1, fan_out, fan_in)
    if qr_method == "shifted_cqr":
      ortho = 16 * rows * r * r
    else:
      ortho = 2 * sketch.sketch_size(r, oversample) * rows * r + 4 * rows * r * r if rows > r else 0
    total += L * (8 * rows * cols * r + ortho)
  return total


def muon_flops(params, ns_steps: int = 5) -> float:
  """Newton–Schulz: per step X Xᵀ, then (b A + c A²) X: 4·s²·l + 2·s³ for s <= l."""
  total = 0.0
  for p in params.values():
    L, a, b = p.shape
    s, l = min(a, b), max(a, b)
    total += L * ns_steps * (4 * s * s * l + 2 * s**3)
  return total


def matmul_case(n: int, count: int):
  """``count`` back-to-back n³ float32 matmuls in one call, ``c ← c @ b``.

  One call then lasts about as long as an optimizer step: on a shared machine a
  4 ms call and a 100 ms call are not equally likely to be interrupted, and timing
  the baseline over a similar window keeps the ratio fair. b is orthogonal, so c
  keeps its norm.
  """
  a = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
  b = jnp.linalg.qr(jax.random.normal(jax.random.key(3), (n, n), jnp.float32))[0]
  chain = lambda a, b: jax.lax.fori_loop(0, count, lambda _, c: c @ b, a)
  return jax.jit(chain), (a, b)


def profile_pieces(params, rank_fraction: float, repeats: int) -> list[tuple[str, float]]:
  """Times each piece of one Dion step over all matrices, as XLA runs it on its own."""
  pieces: dict[str, float] = {}

  def add(name, fn, *args):
    pieces[name] = pieces.get(name, 0.0) + timing.time_fn(jax.jit(fn), args, repeats, warmup=2)

  for p in params.values():
    L, fan_in, fan_out = p.shape
    rows, cols = max(fan_in, fan_out), min(fan_in, fan_out)
    r = dion_jax.dion_rank(rank_fraction, 1, fan_out, fan_in)
    k = sketch.sketch_size(r, 1.25)
    key = jax.random.split(jax.random.key(4), 4)
    B = jax.random.normal(key[0], (L, rows, cols))
    Q = jax.random.normal(key[1], (L, cols, r))
    P = jnp.linalg.qr(jax.random.normal(key[2], (L, rows, r)))[0]
    R_rxr = jnp.linalg.qr(jax.random.normal(key[3], (L, k, r)), mode="r") + 4 * jnp.eye(r)
    seed = jnp.uint32(7)  # One sketch per step serves every matrix, as in the step.
    mm = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
    add("4 products: B Q", lambda B, Q: mm(B, Q), B, Q)
    add("4 products: Bᵀ P", lambda B, P: mm(jnp.swapaxes(B, 1, 2), P), B, P)
    add("4 products: M − c·P Rᵀ", lambda B, P, Q: B - 0.05 * mm(P, jnp.swapaxes(Q, 1, 2)), B, P, Q)
    add("4 products: s·P Qᵀ", lambda P, Q: 2.0 * mm(P, jnp.swapaxes(Q, 1, 2)), P, Q)
    if rows <= r:
      add("householder QR (square P)", jax.vmap(lambda P: jnp.linalg.qr(P)[0]), P)
      continue
    add("rcqr: sketch generation S (k×m)", lambda s: sketch.sketch_block(s, jnp.uint32(0), rows, k), seed)
    add(
        "rcqr: sketch product S P (incl. generation)",
        jax.vmap(lambda P, s: rcqr_xla.xla_sketch_product(P, s, k, jnp.uint32(0)), in_axes=(0, None)),
        P, seed,
    )  # fmt: skip
    add("rcqr: QR of the k×r sketch", jax.vmap(lambda SP: jnp.linalg.qr(SP, mode="r")), R_rxr)
    add("rcqr: solve P R₁⁻¹ + Gram", jax.vmap(rcqr_xla.xla_solve_and_gram), P, R_rxr[:, :r])
    add("rcqr: Cholesky of the Gram", jax.vmap(lambda R: jnp.linalg.cholesky(R.T @ R)), R_rxr[:, :r])
    add("rcqr: solve P₁ R₂⁻¹", jax.vmap(rcqr_xla.xla_solve), P, R_rxr[:, :r])
    add("rcqr: whole orthonormalize", jax.vmap(lambda P, s: qr.rcqr(P, s, backend="xla"), in_axes=(0, None)), P, seed)
  return sorted(pieces.items(), key=lambda kv: -kv[1])


def main():
  parser = harness.matrix_benchmark_parser("dion_step", __doc__.splitlines()[0])
  parser.add_argument("--rank-fractions", type=str, default="1,0.25,0.0625")
  parser.add_argument("--qr-methods", type=str, default="shifted_cqr",
                      help="Dion's orthonormalizations to time, comma-separated (e.g. rcqr,shifted_cqr)")
  parser.add_argument("--matmul-size", type=int, default=1024)
  parser.add_argument("--matmul-count", type=int, default=16,
                      help="matmuls per timed call of the baseline (one call lasts about one Dion step)")  # fmt: skip
  parser.add_argument("--profile", type=float, default=None, metavar="RANK_FRACTION",
                      help="also time the pieces of a Dion step at this rank fraction")  # fmt: skip
  parser.add_argument("--split-qkv", action="store_true", help="query, key and value as three kernels")
  args = parser.parse_args()
  harness.setup_process(platform="cpu")
  fractions = [float(f) for f in args.rank_fractions.split(",")]
  params = harness.gpt_matrices(args.layers, args.d_model, fused_qkv=not args.split_qkv)
  all_dion = lambda p: jax.tree.map(lambda _: "dion", p)
  muon_dims = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)

  muon = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=lambda p: jax.tree.map(lambda _: muon_dims, p))
  txs = {"optax.adamw": (optax.adamw(1e-3), None), "optax.contrib.muon": (muon, muon_flops(params))}
  for method in args.qr_methods.split(","):
    for f in fractions:
      tx = dion_jax.dion(1e-3, rank_fraction=f, qr_method=method, labels=all_dion, backend="xla")
      txs[f"dion rank_fraction={f:g} {method}"] = (tx, dion_flops(params, f, method))
  cases = {"matmul": matmul_case(args.matmul_size, args.matmul_count)}
  state_bytes = {}
  for name, (tx, _) in txs.items():
    step, step_args, state_bytes[name] = timing.jitted_step(tx, params)
    cases[name] = (step, step_args)
  times = timing.interleaved_times(cases, args.rounds, args.repeats)
  kernel = {name: kernel_cost_per_call(fn, fn_args) for name, (fn, fn_args) in cases.items()}
  rate = 2 * args.matmul_size**3 * args.matmul_count / times["matmul"] / 1e9
  t_muon, bytes_adamw = times["optax.contrib.muon"], state_bytes["optax.adamw"]
  rows = [(name, times[name], state_bytes[name], flops) for name, (_, flops) in txs.items()]

  n_params = sum(p.size for p in params.values())
  print(f"\n{args.layers} layers, d_model {args.d_model}: {n_params / 1e6:.1f}M matrix parameters, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}")  # fmt: skip
  print(f"plain float32 matmul {args.matmul_size}³ ({args.matmul_count} per call): {rate:.1f} GFLOP/s, "
        f"{kernel['matmul'][0]:.0f} page faults per call\n")  # fmt: skip
  print("| optimizer | step (ms) | / Muon | GFLOP | GFLOP/s | / matmul | state (MB) | / AdamW state | page faults | kernel ms |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for name, t, nbytes, flops in rows:
    gf = f"{flops / 1e9:.2f}" if flops else "–"
    gfs = f"{flops / t / 1e9:.1f}" if flops else "–"
    frac = f"{flops / t / 1e9 / rate:.0%}" if flops else "–"
    print(f"| {name} | {t * 1e3:.1f} | {t / t_muon:.3f} | {gf} | {gfs} | {frac} | "
          f"{nbytes / 2**20:.1f} | {nbytes / bytes_adamw:.2f} | {kernel[name][0]:.0f} | {kernel[name][1] * 1e3:.1f} |")  # fmt: skip
  print(f"\ncommand: python -m benchmarks.dion_step {' '.join(sys.argv[1:])}".rstrip())

  if args.profile is not None:
    pieces = profile_pieces(params, args.profile, args.repeats)
    print(f"\nDion pieces at rank_fraction={args.profile:g}, each jitted alone, summed over matrices:\n")
    print("| piece | ms |")
    print("| --- | ---: |")
    for name, t in pieces:
      print(f"| {name} | {t * 1e3:.1f} |")


if __name__ == "__main__":
  main()
