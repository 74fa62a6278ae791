"""Collectives over named mesh axes that are the identity when there is no axis.

Inside ``shard_map`` the same matrix code runs sharded and, with no axes, on one
device: every reduction goes through these, so "not sharded" needs no branch at the
call site. ``axes`` is a tuple of mesh axis names, a single name, or None/().
"""
from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp

Axes = Union[str, Sequence[str], None]


def names(axes: Axes) -> tuple[str, ...]:
  if not axes:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def psum(x: jax.Array, axes: Axes) -> jax.Array:
  """``lax.psum`` over ``axes``; ``x`` itself when there are none."""
  return jax.lax.psum(x, names(axes)) if names(axes) else x


def axis_size(axes: Axes) -> int:
  """Devices along ``axes`` (inside ``shard_map``); 1 for none."""
  return jax.lax.psum(1, names(axes)) if names(axes) else 1


def axis_index(axes: Axes) -> jax.Array:
  """This device's uint32 index along ``axes``; 0 for none."""
  return jax.lax.axis_index(names(axes)).astype(jnp.uint32) if names(axes) else jnp.uint32(0)


def sum_then_mean(x: jax.Array, sum_axes: Axes, mean_axes: Axes) -> jax.Array:
  """``pmean(psum(x, sum_axes), mean_axes)`` as one all-reduce over both axis sets.

  One collective over the joint group moves each partial sum once; two nested ones
  would reduce over ``mean_axes`` a value already replicated over ``sum_axes``.
  """
  joint = names(sum_axes) + names(mean_axes)
  if not joint:
    return x
  x = jax.lax.psum(x, joint)
  return x / jax.lax.psum(1, names(mean_axes)) if names(mean_axes) else x
