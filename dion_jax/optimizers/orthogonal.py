"""``scale_by_orthogonal``: Muon, NorMuon, Dion2 or NorDion2
(``dion_jax.optimizers.orthogonal_math``)
as an optax transformation on the shared skeleton, on one device or sharded over the
(rp, fs, tp, pp) mesh.

It shares Dion's bookkeeping: ``dimension_numbers`` name each parameter's fan_in and
fan_out axes (other axes are batches of independent matrices), ``partition_specs`` and
``mesh`` place the state like the parameter (no replica axis: these optimizers need
the whole averaged gradient, so per-replica gradients are averaged over ``rp``
first), and ``scale_rule`` names the update scale.

Megabatches: parameters of one geometry (shape, dimension numbers, heads, PartitionSpec,
dtypes) are stepped as one stacked parameter, one batched orthogonalization per group
(``dion_jax.optimizers.skeleton``); the result is that of each parameter alone.

Per-head orthogonalization (``num_heads``, Muon and NorMuon): the fan_out axis of size
H·d is split into (H, d) and each head is its own (d x fan_in) matrix, for its
orthogonalization, its scale and NorMuon's norms, as the reference's ``num_heads``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from dion_jax import validation
from dion_jax.kernels import backend as backend_lib
from dion_jax.linalg import polar
from dion_jax.optimizers import orthogonal_math as math_lib
from dion_jax.optimizers.frame import MatrixView, leaf_views
from dion_jax.optimizers.routing import matrix_optimizer
from dion_jax.optimizers.skeleton import MatrixRule, scale_by_matrix_rule
from dion_jax.parallel.layout import Layout, Placement
from dion_jax.parallel.mesh import axis_names

# Structural arguments shared by muon, normuon, dion2 and nordion2, for optax.inject_hyperparams
# (as dion_jax.STATIC_ARGS: needed to pass numbers or callables among them); each adds its own.
STATIC_ARGS = ("labels", "scale_rule", "dimension_numbers", "momentum_dtype", "ortho_dtype", "ortho_method",
               "gram_newton_schulz", "lm_head_lr_scale", "cautious_wd", "megabatch_bytes")  # fmt: skip
# The arguments the four share, for their docstrings.
COMMON_DOC = """
    weight_decay, scalar_weight_decay, cautious_wd, scalar_optimizer, scalar_learning_rate, b1, b2,
      scalar_epsilon, lm_head_lr_scale, labels: as for :func:`dion_jax.dion`.
    epsilon, ortho_method, ortho_dtype, gram_newton_schulz, scale_rule, momentum_dtype,
      dimension_numbers, partition_specs, mesh, replicate_sync, backend, megabatch_bytes: see
      :func:`dion_jax.scale_by_orthogonal`.
"""


class ScaleByOrthogonalState(NamedTuple):
  """State of :func:`scale_by_orthogonal`.

  Attributes:
    momentum: per matrix parameter, M in the parameter's layout (``momentum_dtype``).
    variance: NorMuon and NorDion2 only (else empty): per parameter, the second moment
      of each output neuron, float32, the parameter's shape with its fan_in axis of
      size 1.
  """

  momentum: optax.Updates
  variance: optax.Updates


def _variance_shape(view: MatrixView, shape: tuple[int, ...]) -> tuple[int, ...]:
  axis = view.param_fan_in_axis
  return shape[:axis] + (1,) + shape[axis + 1 :]


def _axes(view: MatrixView) -> math_lib.Axes:
  """The mesh axes that shard the (B, a, b) blocks' matrix axes."""
  fr = view.frame
  lo, hi = sorted((fr.row_axis, fr.col_axis))
  return math_lib.Axes(axis_names(fr.spec[lo]), axis_names(fr.spec[hi]))


def _placement(normuon: bool):
  def placement(view: MatrixView, layout: Layout) -> Placement:
    fr = view.frame
    layout.check(fr.shape, fr.spec, fr.name)
    size = layout.size(axis_names(fr.spec[view.out_axis]))
    if view.heads > 1 and view.heads % size:
      raise ValueError(f"num_heads={view.heads} must be divisible by the {size} shards of {fr.name}'s fan_out")
    spec = view.param_spec()
    state = (spec,)
    if normuon:
      variance = list(spec)
      variance[view.param_fan_in_axis] = None
      state += (P(*variance),)
    return Placement(spec, state, (False,) * len(state))

  return placement


def scale_by_orthogonal(
    algorithm: str = "muon",
    *,
    mu: float = 0.95,
    nesterov: bool = False,
    muon_beta2: float = 0.95,
    fraction: float | None = None,
    ef_decay: float = 0.95,
    selection_scope: str = "local",
    epsilon: float = 1e-8,
    ortho_method: str = "polar_express",
    ortho_dtype: Any = "bfloat16",
    gram_newton_schulz: bool = False,
    scale_rule: str | Callable[[int, int], float] | None = "fan_ratio",
    momentum_dtype: Any = None,
    num_heads=None,
    dimension_numbers=None,
    partition_specs=None,
    mesh: jax.sharding.Mesh | None = None,
    replicate_sync: bool = True,
    backend: str = "auto",
    megabatch_bytes: int | None = None,
) -> optax.GradientTransformation:
  """The update direction ``scale·U`` of Muon, NorMuon, Dion2 or NorDion2 for matrix
  parameters.

  Args:
    algorithm: ``"muon"``, ``"normuon"``, ``"dion2"`` or ``"nordion2"``
      (``dion_jax.optimizers.orthogonal_math``).
    mu, nesterov: Muon's and NorMuon's momentum; NorDion2's decay of its selected
      rows of M (the reference's name for it; NorDion2 has no other momentum).
    muon_beta2: NorMuon's and NorDion2's decay of the per-neuron second moment.
    fraction, ef_decay, selection_scope: Dion2's and NorDion2's selected fraction of
      the shorter side (NorDion2: of the output neurons; None: 1/4), Dion2's decay of the
      selected slices of M, and ``"local"`` / ``"global"``.
    epsilon: added to the scaled Frobenius norm before the polar iterations.
    ortho_method: ``"polar_express"`` (five steps, the default), ``"newton_schulz"`` or
      ``"rescaled_newton_schulz"`` (four steps after an AOL rescaling; ``dion_jax.linalg.polar``).
    ortho_dtype: ``"bfloat16"`` (inputs rounded to bf16) or ``"float32"`` (or the jnp dtypes).
    gram_newton_schulz: run the same steps on the short side's Gram matrix for
      matrices at least twice as long as they are short (fewer flops, the same
      polynomials; the reference's ``use_gram_newton_schulz``).
    scale_rule: the update scale from (fan_out, fan_in), as for Dion (aliases
      ``"spectral_norm"``, ``"rms_norm"``, None accepted).
    momentum_dtype: dtype of M (default: the parameter's).
    num_heads: Muon/NorMuon/NorDion2: split each fan_out axis into this many heads; an int,
      a pytree of ints/None matching the parameters, or a callable ``params -> tree``.
    dimension_numbers, partition_specs, mesh, replicate_sync, backend, megabatch_bytes: as
      for :func:`dion_jax.scale_by_dion`; ``backend`` picks the polar iterations' kernels.
  """
  validation.check_choice("algorithm", algorithm, math_lib.ALGORITHMS)
  validation.check_static(f"{algorithm.upper()}_STATIC_ARGS", fraction=fraction, num_heads=num_heads,
                          ortho_dtype=ortho_dtype, momentum_dtype=momentum_dtype)
  fraction = 0.25 if fraction is None else fraction
  validation.check_numbers(mu=mu, muon_beta2=muon_beta2, fraction=fraction, ef_decay=ef_decay, epsilon=epsilon)
  validation.check_choice("selection_scope", selection_scope, math_lib.SELECTION_SCOPES)
  validation.check_choice("ortho_method", ortho_method, tuple(polar.METHODS))
  validation.check_choice("backend", backend, backend_lib.BACKENDS)
  polar.check_dtype(ortho_dtype)
  ortho_dtype = jnp.dtype(ortho_dtype)
  selects = algorithm in ("dion2", "nordion2")
  if algorithm == "dion2" and num_heads is not None:
    raise ValueError("num_heads is supported by Muon, NorMuon and NorDion2 only, as in the reference; got it for dion2")
  if algorithm == "nordion2":
    ef_decay = mu
  hp = math_lib.FamilyHyperParams(
      algorithm, mu, nesterov, muon_beta2, fraction, ef_decay, selection_scope, epsilon,
      ortho_method, ortho_dtype, backend, bool(gram_newton_schulz),
  )  # fmt: skip
  normuon = algorithm in ("normuon", "nordion2")

  def views(params):
    return leaf_views(params, dimension_numbers=dimension_numbers, partition_specs=partition_specs,
                      num_heads=num_heads)

  def init_leaf(view, p, index):
    del index
    momentum = jnp.zeros(p.shape, momentum_dtype or p.dtype)
    return (momentum, jnp.zeros(_variance_shape(view, p.shape), jnp.float32)) if normuon else (momentum,)

  def local_step(view, scale, layout, placement):
    del placement
    axes = math_lib.Axes() if layout is None else _axes(view)
    fr = view.frame

    def step(g, M, *V):
      M_b, g_b = view.to_blocks(M), view.to_blocks(g)
      selected = None
      if selects:
        # Dion2 selects along the shorter side; NorDion2 always selects neurons.
        out_is_longer = algorithm == "dion2" and fr.fan_out > fr.fan_in
        select = view.in_axis if out_is_longer else view.out_axis + (view.heads > 1)
        lo = min(fr.row_axis, fr.col_axis)
        M_b, U, selected = math_lib.dion2_step(M_b, g_b, hp, axes, 1 if select == lo else 2, fr.shape[select])
        selected = selected if algorithm == "nordion2" else None
      else:
        M_b, U = math_lib.muon_step(M_b, g_b, hp, axes)
      new_V = ()
      if normuon:
        U, V_b = math_lib.normuon_normalize(U, view.to_blocks(V[0]), hp, axes, view.blocks_fan_in_axis, selected)
        new_V = (view.from_blocks(V_b, view.split(V[0]).shape),)
      U = view.from_blocks(scale * U, view.split(g).shape).astype(g.dtype)
      return (U, view.from_blocks(M_b, view.split(M).shape)) + new_V

    return step

  fields = ("momentum", "variance") if normuon else ("momentum",)
  rule = MatrixRule(ScaleByOrthogonalState, fields, views, init_leaf, _placement(normuon), local_step, megabatch=True)
  return scale_by_matrix_rule(rule, scale_rule, mesh, replicate_sync, megabatch_bytes)


_DIRECTION_ARGS = frozenset(inspect.signature(scale_by_orthogonal).parameters) - {"algorithm"}
_ROUTING_ARGS = frozenset(inspect.signature(matrix_optimizer).parameters) - {"matrix_direction", "learning_rate"}


def orthogonal_optimizer(algorithm: str, arguments: dict[str, Any]) -> optax.GradientTransformation:
  """:func:`dion_jax.matrix_optimizer` around ``scale_by_orthogonal(algorithm)``: the
  body of ``muon``, ``normuon``, ``dion2`` and ``nordion2``, whose ``arguments`` (their keyword
  arguments and ``learning_rate``) go to whichever of the two takes them."""
  direction = scale_by_orthogonal(algorithm, **{k: v for k, v in arguments.items() if k in _DIRECTION_ARGS})
  routing = {k: v for k, v in arguments.items() if k in _ROUTING_ARGS}
  return matrix_optimizer(direction, arguments["learning_rate"], **routing)
