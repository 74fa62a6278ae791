"""Loss spikes (``--skip-spikes K``): a step whose loss or gradient norm exceeds the mean of
the last :data:`WINDOW` steps by K of their standard deviations is not applied.

The rule of MaxText's ``skip_step_on_spikes`` (``src/maxtext/optimizers/optimizers.py``) and
Levanter's ``SkipStepConfig`` (``src/levanter/optim/skipstep.py``), both after OLMo-core's
``SkipStepOptimizer``; the three default to K = 6 over 128 steps (here the flag is off unless
given). As theirs:

- one-sided: a loss far below the mean is no reason to skip (OLMo-core's z-score takes the
  absolute value);
- checked once half the window is known (OLMo-core: once max(20, half) are);
- the standard deviation with Bessel's correction (MaxText, OLMo-core; Levanter's has none);
- a step's values join the window whether its update was applied or not, so that a lasting
  shift of the loss becomes the new normal instead of stalling the run.

Unlike MaxText's, non-finite values stay out of the window: the step's guard skips those steps
anyway, and one NaN in the window makes its mean NaN, which there skips every step until it
leaves the window.

The window is part of the train state, so checkpoints carry it and a resumed run continues it;
the trainer keeps it whether or not --skip-spikes is on, so turning it on at a resume finds the
history there.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

WINDOW = 128


class SpikeWindow(NamedTuple):
  """The finite losses and gradient norms of the last steps: ring buffers of :data:`WINDOW`,
  the newest at ``(count - 1) % WINDOW``."""
  losses: jax.Array  # float32 [WINDOW]
  grad_norms: jax.Array  # float32 [WINDOW]
  count: jax.Array  # int32: values recorded so far


def empty() -> SpikeWindow:
  return SpikeWindow(jnp.zeros(WINDOW, jnp.float32), jnp.zeros(WINDOW, jnp.float32), jnp.zeros((), jnp.int32))


def _mean_std(x_W: jax.Array, known: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean and unbiased standard deviation of the ``known`` first entries of ``x_W``."""
  mask = jnp.arange(WINDOW) < known
  mean = jnp.sum(jnp.where(mask, x_W, 0.0)) / jnp.maximum(known, 1)
  variance = jnp.sum(jnp.where(mask, (x_W - mean) ** 2, 0.0)) / jnp.maximum(known - 1, 1)
  return mean, jnp.sqrt(variance)


def is_spike(window: SpikeWindow, loss: jax.Array, grad_norm: jax.Array, sigmas: float) -> jax.Array:
  """Whether ``loss`` or ``grad_norm`` exceeds its window's mean by more than ``sigmas`` standard
  deviations (False until half the window is known, and for non-finite values)."""
  known = jnp.minimum(window.count, WINDOW)
  loss_mean, loss_std = _mean_std(window.losses, known)
  norm_mean, norm_std = _mean_std(window.grad_norms, known)
  spike = (loss - loss_mean > sigmas * loss_std) | (grad_norm - norm_mean > sigmas * norm_std)
  return (known >= WINDOW // 2) & spike


def record(window: SpikeWindow, loss: jax.Array, grad_norm: jax.Array) -> SpikeWindow:
  """``window`` with this step's values added, when both are finite."""
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  slot = window.count % WINDOW
  add = lambda x_W, x: x_W.at[slot].set(jnp.where(finite, x.astype(jnp.float32), x_W[slot]))  # noqa: E731
  return SpikeWindow(add(window.losses, loss), add(window.grad_norms, grad_norm), window.count + finite)
