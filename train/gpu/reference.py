"""microsoft/dion's PyTorch Dion and Muon on the ``optimizers`` stage's matrices, timed as
ours are: the reference implementation beside dion_jax, on the same GPU.

Its constructors (microsoft/dion ``dion/dion.py``, ``dion/muon.py``): ``Dion(params,
replicate_mesh=None, ..., rank_fraction=1.0, lr=0.01, qr_method="rcqr")`` and
``Muon(params, distributed_mesh=None, lr=0.01, ...)``. A mesh of None is a world of one,
so one device needs no ``torch.distributed`` setup: Dion then updates one matrix per task
(its batch is the data-parallel world's size) and Muon orthonormalizes each matrix in bf16
Polar Express, as ours. Dion runs RCQR only ("Async Dion only supports qr_method='rcqr'"),
so its flops are ``step_flops(..., qr_method="rcqr")``. Its update functions are
``torch.compile`` d per shape and rank; three ranks of three shapes pass dynamo's default
recompile limit of 8 (issue 44's table lost rank 1/4 to it), so the limit goes to 100, as
microsoft/dion's own ``train.py`` sets it.

Each optimizer holds float32 parameters of the set's shapes in PyTorch's (out, in) layout
with fixed random gradients; its ``step()`` is timed as the mean of ``steps`` chained calls
after ``warmup``, with ``torch.cuda.synchronize`` before the first and after the last
(``timing.throughput_time``). Without torch, a ``dion`` package that has both classes, or a
CUDA device, the stage records one line instead (:data:`SKIP`).
"""
from __future__ import annotations

import math
import time
import traceback

from dion_jax.optimizers.flops import step_flops
from train.gpu.timing import throughput_time

SKIP = "skipped: torch/dion not importable"
NO_CUDA = "skipped: torch sees no CUDA device"
# (row name, class, rank fraction): the names of dion_jax's rows they stand beside, in
# optimizers.CASES's order.
CASES = (("dion r=1/2", "Dion", 0.5), ("muon", "Muon", None), ("dion r=1/4", "Dion", 0.25), ("dion r=1", "Dion", 1.0))


def _modules():
  """(torch, dion), or None where either is missing or ``dion`` is another package."""
  try:
    import dion
    import torch
  except ImportError:
    return None
  return (torch, dion) if hasattr(dion, "Dion") and hasattr(dion, "Muon") else None


def _optimizer(torch, dion, kind: str, rank_fraction: float | None, shapes, device: str):
  """microsoft/dion's optimizer over new parameters of ``shapes`` (ours (in, out), so
  theirs (out, in)) whose gradients are set once."""
  generator = torch.Generator(device).manual_seed(0)
  params = []
  for m, n in shapes:
    p = torch.nn.Parameter(torch.randn(n, m, device=device, generator=generator) / math.sqrt(m))
    p.grad = torch.randn(n, m, device=device, generator=generator) * 1e-2
    params.append(p)
  if kind == "Dion":
    return dion.Dion(params, rank_fraction=rank_fraction, lr=0.01)
  return dion.Muon(params, lr=0.01)


def time_reference(shapes: list[tuple[int, int]], deadline: float, steps: int, warmup: int,
                   device: str | None = None, cases=CASES) -> dict:
  """``{"rows": [{"optimizer", "seconds", "flops"} or {"optimizer", "error"}], "what"}``,
  or ``{"skipped": line}`` (module docstring). ``device``: torch's (default CUDA's)."""
  modules = _modules()
  if modules is None:
    print(f"  microsoft/dion: {SKIP}", flush=True)
    return {"skipped": SKIP}
  torch, dion = modules
  device = device or ("cuda" if torch.cuda.is_available() else None)
  if device is None:
    print(f"  microsoft/dion: {NO_CUDA}", flush=True)
    return {"skipped": NO_CUDA}
  torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 100)
  wait = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
  rows = []
  for name, kind, rank_fraction in cases:
    if time.monotonic() > deadline:
      break
    try:
      optimizer = _optimizer(torch, dion, kind, rank_fraction, shapes, device)
      seconds = throughput_time(lambda: optimizer.step() or (), (), steps, warmup, wait)
      flops = (step_flops("dion", shapes, rank_fraction=rank_fraction, qr_method="rcqr") if kind == "Dion"
               else step_flops("muon", shapes))
      rows.append({"optimizer": name, "seconds": seconds, "flops": flops["total"]})
    except Exception as e:  # noqa: BLE001 (one optimizer's failure is a row; the others still run)
      traceback.print_exc()
      rows.append({"optimizer": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
    optimizer = None
    if device == "cuda":
      torch.cuda.empty_cache()  # back to the pool JAX's later stages share
  return {"rows": rows, "what": f"microsoft/dion ({dion.__file__}) on torch {torch.__version__}, {device}:"
          " Dion by RCQR (its only method), Muon by bf16 Polar Express"}
