"""The Triton modules inside a lowering for CUDA, parsed as the GPU compiler parses them.

Lowering for CUDA on a CPU machine proves the kernels trace, but the Triton module each
kernel becomes is only verified when XLA's GPU compiler parses it. Parsing it here with
the Triton dialect registered runs the same verifiers (``scf.for`` bounds of one type,
operand types of every op), so a module the GPU would reject fails on CPU too.
"""
from __future__ import annotations

import jax
from jax._src.lib import triton  # jaxlib's Triton dialect: private, no public equivalent
from jax._src.lib.mlir import ir

_TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def target_an_h100(monkeypatch) -> None:
  """Lower Pallas' Triton kernels for an H100 on this CPU machine.

  jax 0.10 takes compute capability 9.0 when it finds no GPU; from 0.11 the lowering asks
  the device for its kind and raises on a CPU, so its answer is taken as an H100's (the
  tests take cuDNN's checks as an H100's too).
  """
  try:
    from jax._src.pallas.triton import gpu_info  # private, no public equivalent
  except ImportError:  # jax 0.10
    return
  monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100))


def _custom_calls(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        if inner.name == "stablehlo.custom_call":
          yield inner
        yield from _custom_calls(inner)


def parse_triton_modules(lowered: jax.stages.Lowered) -> list[str]:
  """Each Triton kernel of ``lowered`` as verified MLIR text; raises ``MLIRError`` on an invalid one."""
  texts = []
  for call in _custom_calls(lowered.compiler_ir("stablehlo").operation):
    if ir.StringAttr(call.attributes["call_target_name"]).value not in _TRITON_TARGETS:
      continue
    config = call.attributes["mhlo.backend_config"]
    with ir.Context() as ctx:
      triton.dialect.register_dialect(ctx)
      ctx.load_all_available_dialects()
      texts.append(str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)))
  return texts
