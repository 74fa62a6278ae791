"""``scale_by_orthogonal``: Muon, NorMuon or Dion2 (``dion_jax.family_core``) as an
optax transformation, on one device or sharded over the (rp, fs, tp, pp) mesh.

It shares Dion's bookkeeping: ``dimension_numbers`` name each parameter's fan_in and
fan_out axes (other axes are batches of independent matrices), ``partition_specs`` and
``mesh`` place the state like the parameter (``dion_jax.sharded.Layout``; no replica
axis: these optimizers need the whole averaged gradient, so per-replica gradients are
averaged over ``rp`` first), and ``scale_rule`` names the update scale.

Per-head orthogonalization (``num_heads``, Muon and NorMuon): the fan_out axis of size
H·d is split into (H, d) and each head is its own (d x fan_in) matrix, for its
orthogonalization, its scale and NorMuon's norms, as the reference's ``num_heads``.
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from dion_jax import family_core
from dion_jax import frame as frame_lib
from dion_jax import polar
from dion_jax import transform


class ScaleByOrthogonalState(NamedTuple):
  """State of :func:`scale_by_orthogonal`.

  Attributes:
    momentum: per matrix parameter, M in the parameter's layout (``momentum_dtype``).
    variance: NorMuon only (else empty): per parameter, the second moment of each
      output neuron, float32, the parameter's shape with its fan_in axis of size 1.
  """

  momentum: optax.Updates
  variance: optax.Updates


def _names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclasses.dataclass(frozen=True)
class _View:
  """A parameter seen as a batch of matrices, after the optional split into heads."""

  frame: frame_lib.MatrixFrame  # Of the (head-split) view.
  out_axis: int  # The parameter's fan_out axis (split when heads > 1).
  in_axis: int  # The view's fan_in axis.
  heads: int

  def split(self, x):
    """Splits the fan_out axis of a parameter, or of this device's block of it (whole heads)."""
    if self.heads == 1:
      return x
    o, head_dim = self.out_axis, self.frame.shape[self.out_axis + 1]
    return x.reshape(x.shape[:o] + (x.shape[o] // head_dim, head_dim) + x.shape[o + 1 :])

  def merge(self, x):
    if self.heads == 1:
      return x
    o = self.out_axis
    return x.reshape(x.shape[:o] + (x.shape[o] * x.shape[o + 1],) + x.shape[o + 2 :])

  def to_blocks(self, x):
    """(local) parameter layout -> (B, a, b), the matrix axes in their own order."""
    x = self.frame.to_batch_first(self.split(x))
    return x.reshape((-1,) + x.shape[-2:])

  def from_blocks(self, y, like_shape):
    batch = tuple(like_shape[a] for a in self.frame.batch_axes)
    return self.merge(self.frame.from_batch_first(y.reshape(batch + y.shape[1:])))

  @property
  def blocks_fan_in_axis(self) -> int:
    return 1 if self.in_axis < self.out_axis + (self.heads > 1) else 2

  def axes(self) -> family_core.Axes:
    fr = self.frame
    if fr.spec is None:
      return family_core.Axes()
    lo, hi = sorted((fr.row_axis, fr.col_axis))
    return family_core.Axes(_names(fr.spec[lo]), _names(fr.spec[hi]))


def _view(shape, dims, spec, heads: int | None, name: str) -> _View:
  ndim = len(shape)
  red, out = (a % ndim for a in dims)
  heads = heads or 1
  if heads > 1:
    if shape[out] % heads:
      raise ValueError(f"num_heads={heads} must divide the fan_out axis ({shape[out]}) of {name}")
    shape = shape[:out] + (heads, shape[out] // heads) + shape[out + 1 :]
    if spec is not None:
      entries = tuple(spec) + (None,) * (ndim - len(spec))
      spec = P(*entries[:out], entries[out], None, *entries[out + 1 :])
    red = red + 1 if red > out else red
    dims = frame_lib.DionDimensionNumbers(red, out + 1)
  fr = frame_lib.matrix_frame(tuple(shape), dims, 1.0, 1, spec, name=name)
  return _View(fr, out, red, heads)


def _per_leaf(tree_or_fn, params, is_leaf):
  """``tree_or_fn`` (None, one value, a pytree matched by path, or a callable) per leaf."""
  if callable(tree_or_fn):
    tree_or_fn = tree_or_fn(params)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if tree_or_fn is None or not isinstance(tree_or_fn, (dict, list, tuple)) or is_leaf(tree_or_fn):
    return [tree_or_fn] * len(leaves)
  by_path = {
      jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree_or_fn, is_leaf=is_leaf)[0]
  }
  return [by_path.get(jax.tree_util.keystr(p)) for p, _ in leaves]


def _check(**values) -> None:
  rules = {
      "mu": (lambda v: v >= 0, "a number >= 0"),
      "muon_beta2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
      "ef_decay": (lambda v: v >= 0, "a number >= 0"),
      "fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
      "epsilon": (lambda v: v >= 0, "a number >= 0"),
  }
  choices = {
      "algorithm": family_core.ALGORITHMS,
      "selection_scope": family_core.SELECTION_SCOPES,
      "ortho_method": tuple(polar.METHODS),
      "backend": polar.BACKENDS,
  }
  for name, value in values.items():
    if name in choices:
      if value not in choices[name]:
        raise ValueError(f"{name}={value!r} is not supported; use one of {choices[name]}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not rules[name][0](value):
      raise ValueError(f"{name}={value!r} is invalid; it must be {rules[name][1]}")


def scale_by_orthogonal(
    algorithm: str = "muon",
    *,
    mu: float = 0.95,
    nesterov: bool = False,
    muon_beta2: float = 0.95,
    fraction: float = 0.25,
    ef_decay: float = 0.95,
    selection_scope: str = "local",
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = jnp.bfloat16,
    scale_rule: str | Callable[[int, int], float] | None = "fan_ratio",
    momentum_dtype: Any = None,
    num_heads=None,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
) -> optax.GradientTransformation:
  """The update direction ``scale·U`` of Muon, NorMuon or Dion2 for matrix parameters.

  Args:
    algorithm: ``"muon"``, ``"normuon"`` or ``"dion2"`` (``dion_jax.family_core``).
    mu, nesterov: Muon's and NorMuon's momentum.
    muon_beta2: NorMuon's decay of the per-neuron second moment.
    fraction, ef_decay, selection_scope: Dion2's selected fraction of the shorter
      side, the decay of the selected slices of M, and ``"local"`` / ``"global"``.
    epsilon: added to the scaled Frobenius norm before the polar iterations.
    ortho_method: ``"polar_express"`` or ``"newton_schulz"`` (``dion_jax.polar``).
    ortho_dtype: ``jnp.bfloat16`` (inputs rounded to bf16) or ``jnp.float32``.
    scale_rule: the update scale from (fan_out, fan_in), as for Dion (aliases
      ``"spectral_norm"``, ``"rms_norm"``, None accepted).
    momentum_dtype: dtype of M (default: the parameter's).
    num_heads: Muon/NorMuon: split each fan_out axis into this many heads; an int,
      a pytree of ints/None matching the parameters, or a callable ``params -> tree``.
    dimension_numbers, partition_specs, mesh, replicate_sync, backend: as for
      :func:`dion_jax.scale_by_dion`; ``backend`` picks the polar iterations' kernels.
  """
  _check(
      algorithm=algorithm, mu=mu, muon_beta2=muon_beta2, fraction=fraction, ef_decay=ef_decay,
      selection_scope=selection_scope, epsilon=epsilon, ortho_method=ortho_method, backend=backend,
  )  # fmt: skip
  if jnp.dtype(ortho_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"ortho_dtype={ortho_dtype!r} is not supported; use jnp.bfloat16 or jnp.float32")
  if algorithm == "dion2" and num_heads is not None:
    raise ValueError("num_heads is supported by Muon and NorMuon only, as in the reference; got it for dion2")
  scale_of = transform.scale_rule_fn(scale_rule)
  hp = family_core.FamilyHyperParams(
      algorithm, mu, nesterov, muon_beta2, fraction, ef_decay, selection_scope, epsilon,
      ortho_method, ortho_dtype, backend,
  )  # fmt: skip
  normuon = algorithm == "normuon"
  if mesh is not None:
    from dion_jax import sharded

    layout = sharded.Layout(mesh, replicate_sync, compress=False)

  def views_of(params):
    dims = _per_leaf(dimension_numbers, params, lambda x: isinstance(x, frame_lib.DionDimensionNumbers))
    specs = _per_leaf(partition_specs, params, lambda x: isinstance(x, P))
    heads = _per_leaf(num_heads, params, lambda x: isinstance(x, int))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [
        _view(tuple(x.shape), d or frame_lib.DionDimensionNumbers(), s, h, f"parameter {p or '<root>'}")
        for x, d, s, h, p in zip(jax.tree.leaves(params), dims, specs, heads, paths)
    ]

  def variance_shape(x, view):
    in_axis = view.in_axis - (view.heads > 1 and view.in_axis > view.out_axis)
    return x.shape[:in_axis] + (1,) + x.shape[in_axis + 1 :]

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    views = views_of(params)
    momentum = [jnp.zeros(p.shape, momentum_dtype or p.dtype) for p in leaves]
    variance = [jnp.zeros(variance_shape(p, v), jnp.float32) for p, v in zip(leaves, views)] if normuon else []
    if mesh is not None:
      views = [dataclasses.replace(v, frame=layout._checked(v.frame)) for v in views]
      momentum = [layout._constrain(m, P(*_param_spec(v))) for m, v in zip(momentum, views)]
      variance = [layout._constrain(x, _variance_spec(v)) for x, v in zip(variance, views)]
    unflat = lambda xs: jax.tree.unflatten(treedef, xs) if xs else ()
    return ScaleByOrthogonalState(unflat(momentum), unflat(variance))

  def local_update(view, scale, M, g, *V):
    """One parameter's step on this device's block (or the whole parameter)."""
    axes = view.axes() if mesh is not None else family_core.Axes()
    M_b, g_b = view.to_blocks(M), view.to_blocks(g)
    fr = view.frame
    if algorithm == "dion2":
      out_is_longer = fr.fan_out > fr.fan_in
      select = view.in_axis if out_is_longer else view.out_axis + (view.heads > 1)
      lo = min(fr.row_axis, fr.col_axis)
      M_b, U = family_core.dion2_step(M_b, g_b, hp, axes, 1 if select == lo else 2, fr.shape[select])
    else:
      M_b, U = family_core.muon_step(M_b, g_b, hp, axes)
    new_V = ()
    if normuon:
      U, V_b = family_core.normuon_normalize(U, view.to_blocks(V[0]), hp, axes, view.blocks_fan_in_axis)
      new_V = (view.from_blocks(V_b, view.split(V[0]).shape),)
    U = view.from_blocks(scale * U, view.split(g).shape).astype(g.dtype)
    return (view.from_blocks(M_b, view.split(M).shape), U) + new_V

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    momentum = treedef.flatten_up_to(state.momentum)
    variance = treedef.flatten_up_to(state.variance) if normuon else [None] * len(leaves)
    shapes = leaves if mesh is None else [layout.param_struct(g) for g in leaves]
    views = views_of(jax.tree.unflatten(treedef, shapes))
    new_m, new_v, out = [], [], []
    for g, M, V, view in zip(leaves, momentum, variance, views):
      scale = scale_of(view.frame.fan_out, view.frame.fan_in)
      args = (M, g) + ((V,) if normuon else ())
      if mesh is None:
        res = local_update(view, scale, *args)
      else:
        res = _sharded(layout, view, scale, local_update, args, normuon)
      new_m.append(res[0])
      out.append(res[1])
      new_v += list(res[2:])
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(out), ScaleByOrthogonalState(unflat(new_m), unflat(new_v) if normuon else ())

  return optax.GradientTransformation(init_fn, update_fn)


def _param_spec(view: _View) -> tuple:
  """The parameter's (un-split) PartitionSpec entries, read back from the view's."""
  spec = tuple(view.frame.spec)
  if view.heads == 1:
    return spec
  return spec[: view.out_axis + 1] + spec[view.out_axis + 2 :]


def _variance_spec(view: _View) -> P:
  spec = list(_param_spec(view))
  spec[view.in_axis - (view.heads > 1 and view.in_axis > view.out_axis)] = None
  return P(*spec)


def _sharded(layout, view: _View, scale: float, local_update, args, normuon: bool):
  """``local_update`` inside ``shard_map`` over the parameter's own PartitionSpec."""
  layout._checked(view.frame)
  size = math.prod(dict(layout.mesh.shape)[n] for n in _names(view.frame.spec[view.out_axis]))
  if view.heads > 1 and view.heads % size:
    raise ValueError(f"num_heads={view.heads} must be divisible by the {size} shards of {view.frame.name}'s fan_out")
  pspec = P(*_param_spec(view))
  per_replica = layout.per_replica
  gspec = P("rp", *pspec) if per_replica else pspec

  def local(M, g, *V):
    if per_replica:
      g = jax.lax.pmean(g[0], "rp")
    return local_update(view, scale, M, g, *V)

  vspecs = (_variance_spec(view),) if normuon else ()
  return jax.shard_map(
      local, mesh=layout.mesh, in_specs=(pspec, gspec) + vspecs, out_specs=(pspec, pspec) + vspecs
  )(*args)
