"""FP8 matrix products with per-tensor scaling, current (Transformer Engine's
``Float8CurrentScaling``) or delayed (its ``DelayedScaling``), from ``flax.linen.fp8_ops``'
pieces.

    y = fp8.matmul(x_BxTxK, w_KxN)         # x in the compute dtype, w float32: y in x's dtype
    y = fp8.grouped_matmul(x_RxK, w_GxKxN, group_sizes_G)   # the experts' (ragged_dot)
    y = fp8.delayed_matmul(x_BxTxK, w_KxN, history_3xH)     # scales from an amax history

Forward, the input and the weight are each scaled by their own absolute maximum and cast
to e4m3 (``s = amax / 448``, ``q = round_e4m3(clip(v / s, ±448))``); the product of the two
e4m3 tensors accumulates in float32 and is multiplied by ``s_x·s_w``. Backward, the
output's gradient g is cast likewise to e5m2 (``s_g = amax(g) / 57344``), and the two
products of the backward pass take the e4m3 tensors the forward pass kept::

    dx = (q_g q_wᵀ) · s_g·s_w        dw = (q_xᵀ q_g) · s_x·s_g      (float32 accumulation)

So the forward pass keeps the e4m3 input and weight (a byte an element) for the backward
one, and every product of the three is an FP8 ``dot_general`` with a scalar dequantization
after it: the pattern XLA's GPU compiler rewrites into one cuBLASLt FP8 GEMM with its
scales (``__cublas$lt$matmul$f8``); XLA:CPU emulates the FP8 types.

"Current" scaling: each scale comes from this step's tensor itself, so there is no state
to keep, checkpoint or shard (a delayed recipe's amax history would be). The amax is that
of the whole logical tensor on every mesh: XLA reduces it over the axes its partitioner
shards; inside a ``shard_map`` it is maxed over the manual axes the tensor varies over
(the replicas of Dion's per-replica gradients, cp), except the pipeline's ``pp``, whose
stages hold different layers. Every mesh thus quantizes what one device quantizes for the
same micro-batches (a scalar all-reduce per tensor where a manual axis splits it).

The experts' kernels [G, K, N] take one scale per expert (the amax of each kernel, maxed
over the manual axes that split a kernel, tp, but not over ``ep``, whose ranks hold other
experts): the experts drift apart in magnitude as they train, and one scale for all would
flush a small expert's weights below e4m3's subnormals. The rows keep one scale.

Delayed scaling (:func:`delayed_matmul`): each of the three cast tensors (input, weight,
output gradient) takes its scale from the largest amax of its history of the last
``HISTORY`` steps (``amax_compute_algo="max"``), not from itself, so the cast needs no
reduction of the tensor first; its own amax (the whole logical tensor's, as above) comes
out of the backward pass as the history's cotangent, ``[3, H]`` with the three amaxes in
column 0 and zeros elsewhere: the trainer takes it as a new value (maxed over its
micro-batches, the pipeline's (:func:`repeated`) and replicas, never summed, never given
to the optimizer) and rolls it into
the history (:func:`updated_history`). A history with no amax yet (all zeros: the first
step) scales by the tensor's own amax, as current scaling does. A tensor above its
history's amax saturates at the FP8 type's largest value, as in Transformer Engine; a
non-finite one is not seen by the product but by the trainer's guard, through its amax.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

RECIPES = ("none", "current", "delayed")
HISTORY = 16  # steps of amax a delayed scale looks back over (Transformer Engine's amax_history_len)
HISTORY_NAME = "fp8_history"  # the pure-dict key of a product's history, beside its kernel
FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2
# Manual mesh axes over which a tensor's shards are different tensors, not parts of one;
# with a scale per expert also ep (models.moe.EXPERT_AXIS), whose shards hold other experts.
_OWN_TENSOR_AXES = ("pp",)
_EXPERTS_AXIS = "ep"


def amax(x: jax.Array, per_expert: bool = False) -> jax.Array:
  """max |x| over the whole logical tensor, float32 scalar; ``per_expert``: over each
  expert's slice x[g] of a [G, ...] stack, float32 [G] (module docstring)."""
  m = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)) if per_expert else None).astype(jnp.float32)
  own = _OWN_TENSOR_AXES + ((_EXPERTS_AXIS,) if per_expert else ())
  parts = tuple(a for a in jax.typeof(m).manual_axis_type.varying if a not in own)
  return jax.lax.pmax(m, parts) if parts else m


def quantize(x: jax.Array, dtype, per_expert: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(q, s)``: x in the FP8 ``dtype`` scaled so that its amax is the type's largest
  value, and the float32 scale s (x ≈ q·s; 1 for an all-zero x, NaN for a non-finite one);
  ``per_expert``: each expert's slice x[g] of a [G, ...] stack by its own, s [G]."""
  m = amax(x, per_expert)
  scale = fp8_ops.compute_scale(m, jnp.ones_like(m), fp8_ops.get_fp8_max(dtype, jnp.float32))
  # flax keeps the last scale for a non-finite amax, and the cast would clip an inf to the
  # largest FP8 value: NaN instead, so that an overflow (float16's, which loss scaling
  # must see) reaches the loss and the step's guard as it does without FP8.
  scale = jnp.where(jnp.isfinite(m), scale, jnp.nan)
  return fp8_ops.quantize(x, dtype, scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim)), jnp.float32), scale


def _product(a: jax.Array, b: jax.Array, contract: tuple[Sequence[int], Sequence[int]], scale: jax.Array) -> jax.Array:
  """The FP8 product of ``a`` and ``b`` over the ``contract`` dimensions, accumulated in
  float32 and dequantized by ``scale``."""
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32) * scale


@jax.custom_vjp
def matmul(x: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x @ w_KxN`` (x [..., K]) through FP8 (module docstring), in x's dtype."""
  return _forward(x, w_KxN)[0]


def _forward(x, w_KxN):
  q_x, s_x = quantize(x, FORWARD)
  q_w, s_w = quantize(w_KxN, FORWARD)
  y = _product(q_x, q_w, ((x.ndim - 1,), (0,)), s_x * s_w).astype(x.dtype)
  return y, (q_x, s_x, q_w, s_w, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w_KxN.dtype))


def _backward(residuals, g):
  q_x, s_x, q_w, s_w, x_dtype, w_dtype = residuals
  q_g, s_g = quantize(g, BACKWARD)
  leading = tuple(range(g.ndim - 1))
  dx = _product(q_g, q_w, ((g.ndim - 1,), (1,)), s_g * s_w).astype(x_dtype.dtype)
  dw = _product(q_x, q_g, (leading, leading), s_x * s_g).astype(w_dtype.dtype)
  return dx, dw


matmul.defvjp(_forward, _backward)


class History(nnx.Variable):
  """A delayed product's amax histories, float32 [3, HISTORY]: rows input, weight, output
  gradient; column 0 the newest step's (flax's ``compute_amax_history`` order). Model
  state, not a parameter: the trainer keeps it apart from what the optimizer sees."""


def _scale(history_H: jax.Array, x: jax.Array, dtype) -> jax.Array:
  """The delayed scale of tensor ``x``: its history's largest amax over the ``dtype``'s
  largest value; x's own amax while the history holds none (all zeros). A ``cond``, not a
  select: the cast waits for x's amax reduction in that first step only."""
  largest = jnp.max(history_H)
  m = jax.lax.cond(largest > 0, lambda x: largest, lambda x: _typed_like(amax(x), largest), x)
  return fp8_ops.compute_scale(m, jnp.ones_like(m), fp8_ops.get_fp8_max(dtype, jnp.float32))


def _typed_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` marked as varying over the manual axes ``like`` varies over (the cotangent of a
  history must have its primal's type; ``x``'s value is the same on those ranks)."""
  missing = tuple(a for a in jax.typeof(like).manual_axis_type.varying
                  if a not in jax.typeof(x).manual_axis_type.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


@jax.custom_vjp
def delayed_matmul(x: jax.Array, w_KxN: jax.Array, history_3xH: jax.Array) -> jax.Array:
  """``x @ w_KxN`` (x [..., K]) through FP8 with delayed scaling (module docstring), in x's
  dtype: each of x, w and the output's gradient cast with the scale of its row of
  ``history_3xH``; the history's cotangent is the three tensors' amaxes in column 0."""
  return _delayed_forward(x, w_KxN, history_3xH)[0]


def _delayed_forward(x, w_KxN, history):
  m_x, m_w = amax(x), amax(w_KxN)
  s_x, s_w = _scale(history[0], x, FORWARD), _scale(history[1], w_KxN, FORWARD)
  q_x = fp8_ops.quantize(x, FORWARD, s_x, jnp.float32)
  q_w = fp8_ops.quantize(w_KxN, FORWARD, s_w, jnp.float32)
  y = _product(q_x, q_w, ((x.ndim - 1,), (0,)), s_x * s_w).astype(x.dtype)
  return y, (q_x, s_x, q_w, s_w, m_x, m_w, history, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w_KxN.dtype))


def _delayed_backward(residuals, g):
  q_x, s_x, q_w, s_w, m_x, m_w, history, x_dtype, w_dtype = residuals
  m_g = amax(g)
  s_g = _scale(history[2], g, BACKWARD)
  q_g = fp8_ops.quantize(g, BACKWARD, s_g, jnp.float32)
  leading = tuple(range(g.ndim - 1))
  dx = _product(q_g, q_w, ((g.ndim - 1,), (1,)), s_g * s_w).astype(x_dtype.dtype)
  dw = _product(q_x, q_g, (leading, leading), s_x * s_g).astype(w_dtype.dtype)
  amaxes = jnp.zeros_like(history).at[:, 0].set(jnp.stack([m_x, m_w, m_g]))
  return dx, dw, _typed_like(amaxes, history)


delayed_matmul.defvjp(_delayed_forward, _delayed_backward)


def updated_history(history_3xH: jax.Array, amaxes_3: jax.Array) -> jax.Array:
  """The histories [..., 3, H] rolled one step with the new amaxes [..., 3] in column 0
  (flax's ``compute_amax_history``: the oldest entry drops out)."""
  return jnp.roll(history_3xH, -1, axis=-1).at[..., 0].set(amaxes_3)


@jax.custom_vjp
def repeated(histories, active_I: jax.Array):
  """``histories`` (leaves [...]) repeated for each of a loop's I iterations, leaves
  [I, ...], whose cotangent is the max over the iterations where ``active_I`` (bool [I])
  holds of each iteration's cotangent (its amaxes), not their sum as autodiff of a value
  read in every iteration gives: the pipeline's micro-batches (``models/pipeline.py``).
  Its idle iterations (the bubble: zeros, or a repeat of the last micro-batch) are left
  out, so that what they compute never enters a history."""
  return jax.tree.map(lambda h: jnp.broadcast_to(h, (active_I.shape[0], *h.shape)), histories)


def _repeated_forward(histories, active_I):
  return repeated(histories, active_I), active_I


def _repeated_backward(active_I, amaxes):
  def maxed(a_I):
    return jnp.max(jnp.where(active_I.reshape(-1, *(1,) * (a_I.ndim - 1)), a_I, 0), axis=0)

  return jax.tree.map(maxed, amaxes), None


repeated.defvjp(_repeated_forward, _repeated_backward)


def gradient_rows_scaled(histories, factor: jax.Array):
  """``histories`` (leaves [..., 3, H]) with their gradient rows times ``factor``: the trainer
  keeps the gradient's amaxes in one device's unscaled units, and a replica whose loss is
  its share's mean (``factor`` rp) or a float16 run's scaled loss (its loss scale) sees a
  gradient ``factor`` times larger; dividing by it takes the amaxes back."""
  return jax.tree.map(lambda h: h.at[..., 2, :].multiply(factor.astype(h.dtype)), histories)


def split_state(tree: dict) -> tuple[dict, dict | None]:
  """``(params, histories)`` of a model's pure dict: the histories (the :data:`HISTORY_NAME`
  leaves, their paths kept) apart; None when it holds none."""
  params, histories = {}, {}
  for k, v in tree.items():
    if k == HISTORY_NAME:
      histories[k] = v
    elif isinstance(v, dict):
      params[k], sub = split_state(v)
      if sub is not None:
        histories[k] = sub
    else:
      params[k] = v
  return params, histories or None


def joined(params: dict, histories: dict | None) -> dict:
  """The model's pure dict of ``params`` and ``histories`` (inverse of :func:`split_state`)."""
  if histories is None:
    return params
  return {k: joined(v, histories.get(k)) if isinstance(v, dict) else v for k, v in params.items()} | {
      k: v for k, v in histories.items() if k not in params}


def for_inference(cfg):
  """The model config ``cfg`` (a ``models.GPTConfig``) without amax histories: a delayed
  recipe's products in current scaling (evaluation, sampling and export take the
  parameters, not the training state)."""
  return dataclasses.replace(cfg, fp8="current") if cfg.fp8 == "delayed" else cfg


def inference_graphdef(graphdef, cfg):
  """``graphdef`` (the GPT of ``cfg``), or with a delayed recipe that of :func:`for_inference`'s
  config, whose modules hold no histories."""
  if cfg.fp8 != "delayed":
    return graphdef
  from models.gpt import GPT  # models.gpt imports this module
  return nnx.graphdef(nnx.eval_shape(lambda: GPT(for_inference(cfg), rngs=nnx.Rngs(0))))


# The grouped products' dimensions: rows [R, K] in groups, experts' kernels [G, K, N].
_ROWS_BY_KERNELS = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [0], [0])
_GRADIENT_BY_KERNELS = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
_ROWS_BY_GRADIENT = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])


def _grouped(a, b, group_sizes_G, dims, scale):
  """``jax.lax.ragged_dot_general`` of FP8 ``a`` and ``b``, accumulated in float32 and
  dequantized by ``scale``."""
  return jax.lax.ragged_dot_general(a, b, group_sizes_G, dims, preferred_element_type=jnp.float32) * scale


@jax.custom_vjp
def grouped_matmul(x_RxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """``jax.lax.ragged_dot(x_RxK, w_GxKxN, group_sizes_G)`` (the rows of group g times kernel
  g) through FP8 as :func:`matmul`: one scale for all the rows and one for each expert's
  kernel (Transformer Engine's grouped linear: an expert whose weights are small keeps its
  precision beside large ones), so row r's product is dequantized by ``s_x·s_w[g(r)]``; in
  x's dtype. Backward ``dx = ragged(q_g, q_wᵀ)·s_g·s_w[g(r)]``,
  ``dw[g] = q_x[rows of g]ᵀ q_g[rows of g]·s_x·s_g``, both from the e4m3 tensors kept forward."""
  return _grouped_forward(x_RxK, w_GxKxN, group_sizes_G)[0]


def _row_scales(s_w_G: jax.Array, group_sizes_G: jax.Array, rows: int) -> jax.Array:
  """Each row's expert's kernel scale, float32 [R, 1] (rows past the groups, whose
  products are zeros, take the last expert's)."""
  expert_R = jnp.repeat(jnp.arange(s_w_G.shape[0]), group_sizes_G, total_repeat_length=rows)
  return s_w_G[expert_R][:, None]


def _grouped_forward(x, w, group_sizes):
  q_x, s_x = quantize(x, FORWARD)
  q_w, s_w = quantize(w, FORWARD, per_expert=True)
  rows_scale = _row_scales(s_w, group_sizes, x.shape[0])
  y = _grouped(q_x, q_w, group_sizes, _ROWS_BY_KERNELS, s_x * rows_scale).astype(x.dtype)
  # Empty slices of x and w: their dtypes and the manual axes they vary over.
  return y, (q_x, s_x, q_w, s_w, group_sizes, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _summed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """``ct`` in ``primal``'s dtype, summed over the manual axes it varies over and the
  primal does not (inside a ``shard_map``: the rows of other ranks' tokens), as autodiff
  sums the gradient of a value shared by those ranks."""
  own = set(jax.typeof(primal).manual_axis_type.varying)
  extra = tuple(a for a in jax.typeof(ct).manual_axis_type.varying if a not in own)
  return (jax.lax.psum(ct, extra) if extra else ct).astype(primal.dtype)


def _grouped_backward(residuals, g):
  q_x, s_x, q_w, s_w, group_sizes, x, w = residuals
  q_g, s_g = quantize(g, BACKWARD)
  dx = _grouped(q_g, q_w, group_sizes, _GRADIENT_BY_KERNELS, s_g * _row_scales(s_w, group_sizes, g.shape[0]))
  dw = _grouped(q_x, q_g, group_sizes, _ROWS_BY_GRADIENT, s_x * s_g)
  return _summed_like(dx, x), _summed_like(dw, w), None


grouped_matmul.defvjp(_grouped_forward, _grouped_backward)


@jax.custom_vjp
def delayed_grouped_matmul(x_RxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array,
                           history_Gx3xH: jax.Array) -> jax.Array:
  """:func:`grouped_matmul` with delayed scaling (:func:`delayed_matmul`): the rows, the
  output's gradient and each expert's kernel cast with the scales of its histories, expert
  g's ``history_Gx3xH[g]`` (rows input, weight, output gradient); the rows' and the
  gradient's are those of all the experts' rows, the same in every g. The history's
  cotangent is the amaxes in column 0: the rows' and the gradient's (of all the rows,
  maxed over the ranks that hold other rows), each expert's kernel's."""
  return _delayed_grouped_forward(x_RxK, w_GxKxN, group_sizes_G, history_Gx3xH)[0]


def _expert_scales(history_GxH: jax.Array, m_G: jax.Array) -> jax.Array:
  """Each expert's kernel's delayed scale: its history's largest amax over e4m3's largest
  value; its own amax ``m_G`` while the history holds none."""
  largest_G = jnp.max(history_GxH, axis=-1)
  m = jnp.where(largest_G > 0, largest_G, m_G)
  return fp8_ops.compute_scale(m, jnp.ones_like(m), fp8_ops.get_fp8_max(FORWARD, jnp.float32))


def _delayed_grouped_forward(x, w, group_sizes, history):
  m_x, m_w = amax(x), amax(w, per_expert=True)
  s_x, s_w = _scale(history[:, 0], x, FORWARD), _expert_scales(history[:, 1], m_w)
  q_x = fp8_ops.quantize(x, FORWARD, s_x, jnp.float32)
  q_w = fp8_ops.quantize(w, FORWARD, s_w[:, None, None], jnp.float32)
  y = _grouped(q_x, q_w, group_sizes, _ROWS_BY_KERNELS, s_x * _row_scales(s_w, group_sizes, x.shape[0])).astype(x.dtype)
  return y, (q_x, s_x, q_w, s_w, m_x, m_w, group_sizes, history, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _delayed_grouped_backward(residuals, g):
  q_x, s_x, q_w, s_w, m_x, m_w, group_sizes, history, x, w = residuals
  m_g = amax(g)
  s_g = _scale(history[:, 2], g, BACKWARD)
  q_g = fp8_ops.quantize(g, BACKWARD, s_g, jnp.float32)
  dx = _grouped(q_g, q_w, group_sizes, _GRADIENT_BY_KERNELS, s_g * _row_scales(s_w, group_sizes, g.shape[0]))
  dw = _grouped(q_x, q_g, group_sizes, _ROWS_BY_GRADIENT, s_x * s_g)
  m_Gx3 = jnp.stack(jnp.broadcast_arrays(m_x, m_w, m_g), axis=-1)
  amaxes = jnp.zeros_like(history).at[..., 0].set(m_Gx3)
  return _summed_like(dx, x), _summed_like(dw, w), None, _typed_like(amaxes, history)


delayed_grouped_matmul.defvjp(_delayed_grouped_forward, _delayed_grouped_backward)
