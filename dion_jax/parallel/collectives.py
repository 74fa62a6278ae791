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


def gather(x: jax.Array, axes: Axes, axis: int) -> jax.Array:
  """``x``'s blocks along ``axis`` from every device of ``axes``, joined in their order
  (a tiled all-gather); ``x`` itself when there are none. :func:`own_block` undoes it."""
  if not names(axes):
    return x
  return jax.lax.all_gather(x, names(axes), axis=axis % x.ndim, tiled=True, to="invarying")


def own_block(x: jax.Array, axes: Axes, axis: int) -> jax.Array:
  """This device's block of ``x`` along ``axis`` split over ``axes`` (the block
  :func:`gather` takes from it): local, no communication; ``x`` itself when there are none."""
  if not names(axes):
    return x
  size = x.shape[axis] // axis_size(axes)
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(names(axes)) * size, size, axis)


def sum_then_mean(x: jax.Array, sum_axes: Axes, mean_axes: Axes) -> jax.Array:
  """``pmean(psum(x, sum_axes), mean_axes)``, the mean over ``mean_axes`` taken on a
  1/|sum_axes| part of the sum (a hierarchical all-reduce).

  A reduce-scatter over ``sum_axes`` leaves each device a part of the sum, which is
  averaged over ``mean_axes`` and all-gathered back: the same bytes on the wire as one
  all-reduce over both axis sets, of which only 1/|sum_axes| cross ``mean_axes`` (the
  replicas, which span nodes where the others do not). Nesting a psum and a pmean would
  send all of ``x`` over ``mean_axes``. When ``x`` does not split over ``sum_axes`` (or
  they span one device), one all-reduce over both.
  """
  total, mean = names(sum_axes), names(mean_axes)
  if not mean:
    return psum(x, total)
  if axis_size(total) == 1 or x.size % axis_size(total):
    return jax.lax.psum(x, total + mean) / axis_size(mean)
  part = jax.lax.pmean(jax.lax.psum_scatter(x.reshape(-1), total, scatter_dimension=0, tiled=True), mean)
  return jax.lax.all_gather(part, total, axis=0, tiled=True, to="invarying").reshape(x.shape)


def scatter_sum_then_mean(x: jax.Array, sum_axes: Axes, mean_axes: Axes) -> jax.Array:
  """This device's part of ``pmean(psum(x, sum_axes), mean_axes)``, split along ``x``'s
  leading axis over the devices of ``sum_axes`` + ``mean_axes`` (in that order), which
  must divide it: a reduce-scatter over ``sum_axes``, then one over ``mean_axes`` of
  1/|sum_axes| of ``x`` (:func:`sum_then_mean`'s hierarchy). :func:`gather_back` undoes
  the split."""
  for axes in _levels(sum_axes, mean_axes):
    x = jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
  return x / axis_size(mean_axes)


def gather_back(x: jax.Array, sum_axes: Axes, mean_axes: Axes) -> jax.Array:
  """The whole of what :func:`scatter_sum_then_mean` split, on every device."""
  for axes in reversed(_levels(sum_axes, mean_axes)):
    x = gather(x, axes, 0)
  return x


def _levels(sum_axes: Axes, mean_axes: Axes) -> list[tuple[str, ...]]:
  """The axis sets :func:`scatter_sum_then_mean` reduces over, one after the other (one
  set of both when ``sum_axes`` span one device)."""
  total, mean = names(sum_axes), names(mean_axes)
  if not (total and mean) or axis_size(total) == 1:
    return [total + mean] if total + mean else []
  return [total, mean]
