"""The trainer's whole step (GPT + Dion + clipping), lowered for CUDA on this CPU machine
with every GPU-time decision taken as on a GPU: it holds no CPU-only custom call, the
Pallas kernels are Triton modules the GPU compiler accepts, Dion's factorizations are one
Triton launch per diagonal block for a whole megabatch, with no cuSOLVER or cuBLAS
factorization and outside any loop or conditional, and attention goes to cuDNN's fused
kernels."""

import re

import jax
import pytest
from jax._src.cudnn import fused_attention_stablehlo  # cuDNN's checks query a local GPU

from dion_jax import accounting
from dion_jax.kernels import backend as backend_lib
from dion_jax.linalg import cholesky
from tests import stablehlo_calls
from tests.triton_ir import parse_triton_modules
from train.run import config as config_lib
from train.run import loop, setup


@pytest.fixture
def as_on_a_gpu(monkeypatch, h100):
  """Choices made when tracing (dtype, attention, Pallas or XLA, batched QR) as on a GPU.

  cuDNN's version and compute-capability checks read the local CUDA runtime, which a
  CPU machine lacks: they are taken as an H100's, and so is the GPU the Triton kernels
  lower for (``h100``).
  """
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda capability: True)
  # cuDNN's kernels do not compile for this CPU: setup's compile and memory check is skipped
  # (and the communication it reads off the compiled step), the tests lower the step themselves.
  monkeypatch.setattr(setup, "compile_within_memory", lambda *args: None)
  monkeypatch.setattr(setup.comm, "describe", lambda *args: {"bytes_per_device_and_step": {}, "dion_replica_sync": None})


def _traced_step(tmp_path, optimizer: str, dtype: str | None = None, preset: str = "tiny",
                 **overrides) -> tuple[jax.stages.Traced, jax.sharding.Mesh]:
  cfg = config_lib.Config(preset=preset, optimizer=optimizer, steps=1, global_batch_size=4,
                          eval_tokens=0, save_every=0, mesh="fs=1", run_dir=str(tmp_path / optimizer),
                          dtype=dtype, **overrides)
  cfg.check()
  run = setup.setup(cfg)
  assert run.model_cfg.dtype == (dtype or "bfloat16") and run.model_cfg.attention == "cudnn"
  batch = loop.global_batch(run, next(run.data.loader))
  with jax.set_mesh(run.mesh):
    return run.train_step.trace(run.state, batch), run.mesh


def _lowered_step(tmp_path, optimizer: str, **kwargs) -> jax.stages.Lowered:
  traced, mesh = _traced_step(tmp_path, optimizer, **kwargs)
  with jax.set_mesh(mesh):
    return traced.lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("optimizer,preset", [("dion", "tiny"), ("muon", "tiny"), ("dion", "tiny-moe")])
def test_train_step_lowers_for_cuda_without_cpu_custom_calls(tmp_path, as_on_a_gpu, monkeypatch, optimizer, preset):
  """With the Pallas kernels chosen (``backend="auto"`` is XLA today), the whole step holds
  Triton modules the GPU compiler accepts."""
  monkeypatch.setattr(backend_lib, "resolve", lambda backend: "xla" if backend == "xla" else "pallas")
  lowered = _lowered_step(tmp_path, optimizer, preset=preset)
  text = lowered.as_text()
  targets = set(re.findall(r"custom_call @([\w$.]+)", text))
  if preset == "tiny-moe":  # the experts' grouped matmuls stay one op for XLA:GPU to lower
    assert "ragged_dot" in text
  assert not {t for t in targets if "lapack" in t or t.startswith("cpu")}, targets
  assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= targets, targets
  modules = parse_triton_modules(lowered)  # Dion's RCQR passes or Muon's Newton–Schulz products
  assert modules, targets
  if optimizer == "dion":  # Dion's Cholesky QR: Triton, not cuSOLVER
    assert not {t for t in targets if t.startswith(("cusolver", "cublas"))}, targets


def test_float16_step_lowers_with_cudnn_attention_in_float16(tmp_path, as_on_a_gpu):
  """--dtype float16 picks cuDNN's fused attention on a GPU too (auto), fed float16, with
  the loss-scaled step around it."""
  text = _lowered_step(tmp_path, "dion", dtype="float16").as_text()
  calls = [line for line in text.splitlines() if "custom_call @__cudnn$fmhaSoftmax" in line]
  assert len(calls) >= 2 and all("xf16>" in line for line in calls), calls


@pytest.mark.parametrize("rank_fraction,blocks", [(0.5, 3), (0.25, 2)])
def test_dion_step_factorizes_batched_without_loops_or_conditionals(tmp_path, as_on_a_gpu, rank_fraction, blocks):
  """Dion's default orthonormalization in the whole ``small`` step at ranks 1/2 and 1/4
  (r = 384, 192; rank 1's r = 768 takes 6 blocks by the same rule, and twice these two's
  compile time): no cuSOLVER or cuBLAS factorization (before issue 44: 16 batched
  potrf and 16 batched trsm, about 2r/16 + r/64 + 4 launches each, 1,760 per step at
  rank 1), no Householder QR, no loop, no conditional (an XLA:GPU conditional copies its
  predicate to the host). The megabatches {query, key, value}, {out} (row-parallel: its
  own frame), {up}, {down} take 4 shifted Cholesky QR passes each, and each pass one
  Triton launch per diagonal block of 128 for the whole megabatch: 16·r/128. Two of the
  preset's 12 layers: a megabatch stacks every layer, so its launches do not depend on depth."""
  traced, mesh = _traced_step(tmp_path, "dion", preset="small", dion_rank_fraction=rank_fraction, num_layers=2)
  per_run, in_while = accounting.primitive_counts(traced.jaxpr)
  assert cholesky.block_size(int(768 * rank_fraction)) == 128
  assert per_run["pallas_call"] == 4 * 4 * blocks, per_run
  assert not {"cholesky", "triangular_solve", "geqrf", "householder_product", "cond", "while"} & (
      set(per_run) | set(in_while)), (per_run, in_while)
  with jax.set_mesh(mesh):
    lowered = traced.lower(lowering_platforms=("cuda",))
  assert not stablehlo_calls.factorization_calls(lowered)
  reached = stablehlo_calls.reached_ops(lowered)
  assert not {r.op for r in reached} & {"stablehlo.case", "stablehlo.if"}, reached
  assert all(not r.inside for r in reached if r.op == "__gpu$xla.gpu.triton"), reached  # the loops are the model's
  assert len(parse_triton_modules(lowered)) == 4 * 4 * blocks  # each a module the GPU compiler accepts


def test_dion_polar_step_asks_for_no_factorization(tmp_path, as_on_a_gpu):
  """``--dion-qr-method polar``: Polar Express on P, matmuls only."""
  traced, _ = _traced_step(tmp_path, "dion", preset="small", dion_rank_fraction=0.5, dion_qr_method="polar",
                             num_layers=2)
  per_run, in_while = accounting.primitive_counts(traced.jaxpr)
  assert not {"cholesky", "triangular_solve", "geqrf", "pallas_call", "while"} & (set(per_run) | set(in_while))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_step_multiplies_the_blocks_in_fp8(tmp_path, as_on_a_gpu, recipe):
  """--fp8 (and --fp8 delayed, its scales from the amax histories): the layer's 6 products (query, key, value, out, MLP up and down) and the 12 of
  their backward pass are FP8 dot_generals (e4m3 x e4m3 forward, e5m2 gradients against
  e4m3 tensors backward) accumulating in float32, each result multiplied by its scale
  (XLA:GPU's pattern for a cuBLASLt FP8 GEMM); only the LM head's 3 stay bfloat16 (the
  layers' scan body holds one layer; attention is cuDNN's)."""
  text = _lowered_step(tmp_path, "adamw", fp8=recipe).as_text()
  dots = re.findall(r"(%\w+) = stablehlo.dot_general .*: \(tensor<[\dx]+x(\w+)>, tensor<[\dx]+x(\w+)>\) -> tensor<[\dx]+x(\w+)>", text)
  kinds = {}
  for _, *types in dots:
    kinds[tuple(types)] = kinds.get(tuple(types), 0) + 1
  e4m3, e5m2 = "f8E4M3FN", "f8E5M2"
  assert kinds == {(e4m3, e4m3, "f32"): 6, (e5m2, e4m3, "f32"): 6, (e4m3, e5m2, "f32"): 6,
                   ("bf16", "bf16", "bf16"): 3}, kinds
  for result, *types in dots:
    if types[0].startswith("f8"):  # dequantized: the product times the scales' product
      # (through a float32 reduce_precision, the recompute's no-op barrier, where there is one)
      same = re.search(rf"(%\w+) = stablehlo.reduce_precision {result}, format = e8m23", text)
      product = same.group(1) if same else result
      assert re.search(rf"stablehlo.multiply {product}, %\w+ : tensor<[\dx]+xf32>", text), result
