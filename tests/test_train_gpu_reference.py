"""microsoft/dion's optimizers in the ``optimizers`` stage, on CPU: one line where they
cannot run, and the timing and flops of each case with a stand-in ``dion`` package (the real
one is not installed here; a GPU session times it)."""

import math
import sys
import types

import pytest

from dion_jax.optimizers.flops import step_flops
from train.gpu import reference

SHAPES = [(64, 64), (64, 256), (256, 64)]


def test_without_dion_one_line(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "dion", None)  # as when it is not installed
  assert reference.time_reference(SHAPES, math.inf, steps=2, warmup=1) == {"skipped": reference.SKIP}
  assert capsys.readouterr().out == f"  microsoft/dion: {reference.SKIP}\n"


def test_another_package_named_dion_is_not_microsofts(monkeypatch):
  monkeypatch.setitem(sys.modules, "dion", types.ModuleType("dion"))
  pytest.importorskip("torch")
  assert reference.time_reference(SHAPES, math.inf, steps=2, warmup=1) == {"skipped": reference.SKIP}


def test_each_case_is_timed_over_chained_steps_on_torch_s_layout(monkeypatch):
  torch = pytest.importorskip("torch")
  made = []

  class Stand(torch.optim.SGD):
    """Records how the stage builds and steps microsoft/dion's optimizers."""

    def __init__(self, params, **options):
      super().__init__(params, lr=options["lr"])
      self.options, self.steps = options, 0
      made.append(self)

    def step(self, closure=None):
      self.steps += 1
      return super().step(closure)

  dion = types.ModuleType("dion")
  dion.__file__ = "stand-in"
  dion.Dion = type("Dion", (Stand,), {})
  dion.Muon = type("Muon", (Stand,), {})
  monkeypatch.setitem(sys.modules, "dion", dion)
  out = reference.time_reference(SHAPES, math.inf, steps=4, warmup=3, device="cpu")
  assert [r["optimizer"] for r in out["rows"]] == ["dion r=1/2", "muon", "dion r=1/4", "dion r=1"]
  assert out["what"].startswith("microsoft/dion (stand-in) on torch")
  assert [type(o).__name__ for o in made] == ["Dion", "Muon", "Dion", "Dion"]
  assert [o.options.get("rank_fraction") for o in made] == [0.5, None, 0.25, 1.0]
  for optimizer, row in zip(made, out["rows"]):
    assert optimizer.steps == 3 + 4 and row["seconds"] > 0
    params = optimizer.param_groups[0]["params"]
    assert [tuple(p.shape) for p in params] == [(n, m) for m, n in SHAPES]  # (out, in)
    assert all(p.grad is not None for p in params)
  assert out["rows"][0]["flops"] == step_flops("dion", SHAPES, rank_fraction=0.5, qr_method="rcqr")["total"]
  assert out["rows"][1]["flops"] == step_flops("muon", SHAPES)["total"]


def test_no_case_starts_after_the_deadline(monkeypatch):
  pytest.importorskip("torch")
  dion = types.ModuleType("dion")
  dion.__file__, dion.Dion, dion.Muon = "stand-in", object, object
  monkeypatch.setitem(sys.modules, "dion", dion)
  assert reference.time_reference(SHAPES, deadline=0.0, steps=1, warmup=1, device="cpu")["rows"] == []
