"""The planner's step-time-versus-matrix-size curve (``benchmarks.plan_figures``) against
the roofline computed by hand from the data sheet (H100 SXM: 989 TFLOP/s bf16 dense,
3.35 TB/s HBM) at the planner's default 50% of peak."""
import pytest

from benchmarks import plan_figures

PEAK, HBM = 989e12, 3.35e12


@pytest.mark.parametrize("optimizer,rank,n,rate,expected_s", [
    # Dion: B Q, Bᵀ P, P Rᵀ, P Qᵀ, 2·n·n·r flops each, r = n/4, TF32 (half the bf16 peak)
    ("dion", 0.25, 4096, 0.5, 8 * 4096**2 * 1024 / (PEAK * 0.5 * 0.5)),
    # Muon: five Newton–Schulz steps of 6·n³ (X Xᵀ, its square, the product with X), bf16
    ("muon", 1.0, 8192, 1.0, 5 * 6 * 8192**3 / (PEAK * 0.5)),
    # AdamW: no matmul; 7 float32 passes over the matrix (4 reads, 3 writes)
    ("adamw", 1.0, 8192, 1.0, 7 * 4 * 8192**2 / HBM),
    # Dion at rank 1/16 of n = 1024 is bound by its 9 float32 passes, not its flops
    ("dion", 1 / 16, 1024, 0.5, 9 * 4 * 1024**2 / HBM),
])
def test_planned_update_time_is_the_roofline(optimizer, rank, n, rate, expected_s):
  assert plan_figures.predicted_ms(optimizer, rank, n, rate) == pytest.approx(1e3 * expected_s, rel=1e-12)


def test_size_rows_pair_each_measured_number_with_its_plan():
  measured = {"optimizers": {"rows": [{"n": 2048, "muon": 1.0, "dion r=1/4": "out of memory"}]}}
  rows = plan_figures.size_rows(measured)
  assert [(r["optimizer"], r["n"]) for r in rows] == [("Muon", 2048)]
  assert rows[0]["ratio"] == pytest.approx(1.0 / (1e3 * 30 * 2048**3 / (PEAK * 0.5)), rel=1e-12)
