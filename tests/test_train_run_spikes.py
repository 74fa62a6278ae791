"""--skip-spikes: the window's statistics against NumPy, and a planted batch of tokens the corpus
never holds (byte 255: no UTF-8 text has it) skipped with --skip-spikes 6 and applied without.

The runs are the smallest GPT of ``tests/test_train_run_faults.py`` on one device; the spike comes
after 69 steps, once the window (128 steps) is half full and checks.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_train_run_faults import TINY
from tests.test_train_gpt import compile_cache, records  # noqa: F401  fixture
from train import gpt
from train.run import loop, spikes

PLANTED = 70  # the first step that can be skipped: 69 known values fill more than half the window


def numpy_stats(values: list[float]) -> tuple[float, float]:
  """Mean and unbiased standard deviation of the last WINDOW finite values, in float64."""
  kept = np.array([v for v in values if np.isfinite(v)][-spikes.WINDOW:], np.float64)
  return kept.mean(), kept.std(ddof=1)


def test_the_window_keeps_the_last_finite_values_and_tests_against_their_mean_and_deviation():
  """300 values (the ring wraps twice), some of them NaN or inf: the statistics are those of
  the last 128 finite ones in float64 NumPy (within float32 rounding); a value is a spike
  when it is more than K deviations above, of the loss or of the gradient norm, and not
  before 64 values are known."""
  rng = np.random.default_rng(0)
  losses = rng.normal(3.0, 0.5, 300).astype(np.float32)
  norms = rng.lognormal(0.0, 0.3, 300).astype(np.float32)
  losses[[5, 77, 200]] = [np.nan, np.inf, np.nan]
  norms[150] = np.inf
  record, is_spike = jax.jit(spikes.record), jax.jit(spikes.is_spike, static_argnums=3)
  window = spikes.empty()
  for i, (loss, norm) in enumerate(zip(losses, norms)):
    finite = [(a, b) for a, b in zip(losses[:i], norms[:i]) if np.isfinite(a) and np.isfinite(b)]
    if len(finite) >= 64:
      loss_mean, loss_std = numpy_stats([a for a, _ in finite])
      norm_mean, norm_std = numpy_stats([b for _, b in finite])
      for probe_loss, probe_norm, want in [(loss_mean + 5.9 * loss_std, norm_mean, False),
                                           (loss_mean + 6.1 * loss_std, norm_mean, True),
                                           (loss_mean, norm_mean + 6.1 * norm_std, True),
                                           (loss_mean - 9 * loss_std, norm_mean - 9 * norm_std, False)]:
        assert bool(is_spike(window, jnp.float32(probe_loss), jnp.float32(probe_norm), 6.0)) == want, i
    else:
      assert not bool(is_spike(window, jnp.float32(1e9), jnp.float32(1e9), 6.0)), i
    window = record(window, jnp.float32(loss), jnp.float32(norm))
  assert int(window.count) == sum(np.isfinite(losses) & np.isfinite(norms))


def out_of_distribution(local: dict) -> dict:
  return {**local, "inputs": np.full_like(local["inputs"], 255), "targets": np.full_like(local["targets"], 255)}


@pytest.mark.parametrize("sigmas", [6.0, 0.0])
def test_a_planted_spike_is_not_applied_with_skip_spikes_and_applied_without(  # noqa: F811
    compile_cache, tmp_path, sigmas):  # noqa: F811
  """Step 70's batch is byte 255 throughout (loss 7.5 and gradient norm 22.5, where the steps
  before had about 2.7 and 1.2): with --skip-spikes 6 the step is a spike, skipped, and parameters,
  optimizer state and the update count are the step's inputs bit for bit while its values join
  the window; with --skip-spikes 0 it is applied."""
  run = gpt._setup([*TINY, "--eval-tokens", "0", "--run-dir", str(tmp_path / "run"), "--skip-spikes", str(sigmas)])
  run.directory.close()
  state = run.state
  with jax.set_mesh(run.mesh):
    for step in range(1, PLANTED):
      state, metrics = run.train_step(state, loop.global_batch(run, next(run.data.loader)))
      assert not metrics.skipped, step
    before = jax.device_get(state)
    state, metrics = run.train_step(state, loop.global_batch(run, out_of_distribution(next(run.data.loader))))
  after = jax.device_get(state)
  assert float(metrics.loss) > 5.0 and float(metrics.grad_norm) > 10.0
  assert bool(metrics.spike) == bool(metrics.skipped) == (sigmas > 0)
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves((before.params, before.opt_state)),
                                                      jax.tree.leaves((after.params, after.opt_state)))]
  assert not any(changed) if sigmas else all(changed[:len(jax.tree.leaves(before.params))])
  assert int(after.updates) == int(before.updates) + (sigmas == 0)
  assert int(after.spikes.count) == PLANTED


def train(run_dir, plant: bool, monkeypatch, *args) -> int:
  """train.gpt on TINY, step 70's batch out of the corpus's distribution when ``plant``."""
  global_batch = loop.global_batch
  calls = []

  def batch(run, local):
    calls.append(1)
    return global_batch(run, out_of_distribution(local) if plant and run.start_step + len(calls) == PLANTED else local)

  monkeypatch.setattr(loop, "global_batch", batch)
  return gpt.main([*TINY, "--eval-tokens", "0", "--run-dir", str(run_dir), *args])


def test_spikes_are_logged_counted_by_max_skipped_and_resume_with_their_window(  # noqa: F811
    compile_cache, tmp_path, monkeypatch, capsys):  # noqa: F811
  """With --skip-spikes 6 step 70 is logged as skipped and as a spike (the line and
  metrics.jsonl). A resume from step 69 skips it again: the window came back with the
  checkpoint (a fresh one checks nothing before 64 steps), and the steps after are the same
  bit for bit. --max-skipped 1 stops at the spike (exit 3); without --skip-spikes it is applied."""
  run_dir = tmp_path / "run"
  assert train(run_dir, True, monkeypatch, "--skip-spikes", "6", "--steps", "71", "--save-every", "69") == 0
  out = capsys.readouterr().out
  first = {r["step"]: r for r in records(run_dir) if "loss" in r}
  assert (first[PLANTED]["skipped"], first[PLANTED]["spikes"]) == (1, 1)
  assert all((r["skipped"], r["spikes"]) == (0, 0) for step, r in first.items() if step != PLANTED)
  line = next(line for line in out.splitlines() if line.startswith(f"iteration {PLANTED:8d}/"))
  assert line.endswith("skipped iterations: 1 | nan iterations: 0 | spike iterations: 1"), line

  assert train(run_dir, True, monkeypatch, "--resume", "--step", "69") == 0
  again = records(run_dir)[len(first):]
  assert [r["step"] for r in again] == [70, 71] and again[0]["spikes"] == 1
  assert [r["loss"] for r in again] == [first[s]["loss"] for s in (70, 71)]

  assert train(run_dir, True, monkeypatch, "--resume", "--step", "69", "--max-skipped", "1") == 3
  err = capsys.readouterr().err.splitlines()[-1]
  assert err.startswith("error: stopped after 1 consecutive iterations with a non-finite loss, gradient or"
                        " update or a spiking loss or gradient norm (--skip-spikes) (--max-skipped 1)"), err

  assert train(run_dir, True, monkeypatch, "--resume", "--step", "69", "--skip-spikes", "0") == 0
  applied = {r["step"]: r for r in records(run_dir) if "loss" in r}
  assert applied[PLANTED]["skipped"] == 0 and "spikes" not in applied[PLANTED]
  assert applied[71]["loss"] != first[71]["loss"]
  assert json.load(open(run_dir / "config.json"))["train"]["skip_spikes"] == 0.0
