"""The GPT's training loss, on one device or in a ``shard_map`` manual over pp and cp.

    loss = models.loss(graphdef, params, batch, par)     # batch: "inputs", "targets" [B, T]

Batches are dicts of int [B, T]: "inputs" and "targets" (a target -1 is not counted), and
for packed sequences "segment_ids" (attention stays within a segment) and "positions"
(the rotary position of each token, restarting at each document). Without pp or cp the
layers run in one scan (``models.gpt.apply_layers``) and XLA partitions TP, SP and FS from
annotations; with pp > 1 or cp > 1 the whole model runs inside one ``shard_map``
(``models/pipeline.py``, ``models/context.py``).

A per-token ``objective`` (GRPO's: ``train/grpo/objective.py``) replaces the cross-entropy
with its own terms of each target's log-probability (and its distribution's entropy) at a
``temperature``, read from more [B, T] batch fields, on the same forward; :func:`token_logps`
gives those log-probabilities.

With experts (``models/moe.py``) the loss adds each MoE layer's load-balancing and z-losses,
averaged over the sequences of the global batch.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from dion_jax import parallel
from models import context, moe, pipeline
from models.gpt import apply_layers, rotary_tables
from models.lm_head import head_terms
from models.sharding import Parallelism, param_specs, to_layers, to_stages


class LossAux(NamedTuple):
  """What the forward pass reports beside the loss (``models.loss(..., aux=True)``).

  Attributes:
    logit_max: [S, Ls, N] each layer's and query head's largest attention logit over the
      batch (QK-clip's input, ``models.qk_clip``), with ``logit_max``; else None. [S, Gs,
      moe_every, N] when the layers run in groups (``GPTConfig.group_size`` > 1).
    router: each MoE layer's :class:`models.moe.RouterStats` summed over the batch, leaves
      [S, Ls] ([S, Ls, E] for the load; Gs for Ls with groups); None without experts.
    router_loss: the auxiliary losses' part of the loss, unscaled (0 without experts).
    stats: with an ``objective``, its statistics' terms summed over the batch; else None.
  """
  logit_max: jax.Array | None
  router: moe.RouterStats | None
  router_loss: jax.Array
  stats: Any = None


# The batch's fields that are not per-token values of the targets (those others are).
_SEQUENCE_FIELDS = ("inputs", "positions", "segment_ids")


def loss(graphdef: Any, params: Any, batch: dict[str, jax.Array], par: Parallelism = Parallelism(),
         scale: jax.Array | None = None, denominator: jax.Array | None = None,
         sequences: jax.Array | None = None, aux: bool = False, logit_max: bool = False,
         objective: Callable | None = None, temperature: float = 1.0) -> Any:
  """Next-token cross-entropy of ``batch`` (module docstring), summed over the counted
  targets (those >= 0) and divided by ``denominator`` (default: their number, the mean),
  plus the router's auxiliary losses divided by ``sequences`` (default: the batch's
  sequences), times ``scale`` when given.

  With ``objective``, ``objective(logps_BxT, entropies_BxT, fields) -> (terms_BxT, stats)``
  takes the place of the cross-entropy: ``logps_BxT`` the targets' log softmax(logits /
  ``temperature``) and ``entropies_BxT`` the entropies of those distributions (each 0
  where a target is -1; both differentiable), ``fields`` the batch's [B, T] fields but inputs, positions and
  segment ids (the targets and the objective's own, split with them over micro-batches
  and cp); the sum of ``terms_BxT`` is divided by ``denominator`` and the sums of the
  ``stats`` pytree's [B, T] leaves come back in ``LossAux.stats``.

  With ``aux`` returns ``(loss, LossAux)``; ``logit_max`` (which needs ``aux``) adds the
  attention's logit maxima, at the cost of forming the scores a second time.

  A train step over micro-batches or replicas passes the counts of the whole global batch
  as ``denominator`` and ``sequences``, so that their losses add up to its mean exactly.

  With pp > 1 the batch is split into ``par.microbatches`` micro-batches that flow
  through the pipeline; otherwise the whole batch goes through the layer scan at once.
  With cp > 1 every sequence is split over cp (``models/context.py``).
  On a mesh, call it under ``jax.set_mesh(par.mesh)``.

  ``scale`` is a float16 run's loss scale: it multiplies the loss here, not in the
  caller, because the pipeline takes its gradient inside its ``shard_map``, and the
  float16 backward pass must see the scaled cotangent there.
  """
  if par.mesh is not None and jax.sharding.get_abstract_mesh().empty:
    raise ValueError("models.loss on a mesh must run under `with jax.set_mesh(par.mesh):`")
  if logit_max and not aux:
    raise ValueError("models.loss: logit_max=True needs aux=True (the maxima are in its LossAux)")
  counted_BxT = batch["targets"] >= 0
  if denominator is None:
    denominator = jnp.maximum(jnp.sum(counted_BxT), 1).astype(jnp.float32)
  if sequences is None:
    sequences = jnp.asarray(batch["targets"].shape[0], jnp.float32)
  if par.pp > 1 or par.cp > 1:
    value, out = _manual_loss(graphdef, params, batch, scale, denominator, sequences, par, logit_max, objective,
                              temperature)
    return (value, out) if aux else value
  model = nnx.merge(graphdef, params)
  x, layer_aux = _forward(model, params, batch, par, logit_max)
  total, stats = _token_terms(model, x, _token_fields(batch), par, objective, temperature)
  router = layer_aux.get("router")
  extra = _router_loss(router, model.cfg, sequences, batch["inputs"].shape[1])
  value = _scaled(total / denominator + extra, scale)
  if not aux:
    return value
  return value, LossAux(*(None if a is None else to_stages(a, 1) for a in (layer_aux.get("logit_max"), router)),
                        extra, stats)


def token_logps(graphdef: Any, params: Any, batch: dict[str, jax.Array], par: Parallelism = Parallelism(),
                temperature: float = 1.0, entropy: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Each target's log softmax(logits / ``temperature``), float32 [B, T] (0 where the
  target is -1; the vocabulary's padding rows left out), without gradient, by
  :func:`loss`'s forward: with pp > 1 or cp > 1 the same pipeline and context split. With
  ``entropy`` also the entropy of each of those distributions [B, T] (0 where the target is -1)."""
  if par.pp > 1 or par.cp > 1:
    return _manual_call(graphdef, jax.lax.stop_gradient(params), batch, None, None, None, par, False, None,
                        temperature, mode="entropy" if entropy else "logps")
  params = jax.lax.stop_gradient(params)
  model = nnx.merge(graphdef, params)
  x_BxTxD, _ = _forward(model, params, batch, par)
  return _target_logps(model, x_BxTxD, batch["targets"], par, temperature, entropy)


def _forward(model: Any, params: Any, batch: dict[str, jax.Array], par: Parallelism, logit_max: bool = False
             ) -> tuple[jax.Array, dict]:
  """The layers' output [B, T, D] and aux on one device or XLA-partitioned (no pp, cp)."""
  positions = batch["positions"] if "positions" in batch else jnp.arange(batch["inputs"].shape[1])
  x = model.embed_tokens(batch["inputs"], par)
  return apply_layers(nnx.graphdef(model.blocks), to_layers(params["blocks"], 1), x,
                      rotary_tables(model.cfg, positions), par, model.cfg, batch.get("segment_ids"), logit_max)


def _token_fields(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return {k: v for k, v in batch.items() if k not in _SEQUENCE_FIELDS}


def _target_logps(model: Any, x_BxTxD: jax.Array, targets_BxT: jax.Array, par: Parallelism,
                  temperature: float, entropy: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """log softmax(logits / temperature) of each target [B, T], float32, 0 where the target
  is -1; vocab-parallel over tp and ``loss_chunk`` tokens at a time as ``GPT.token_losses``,
  the padding rows left out (as the sampler draws). With ``entropy`` also each
  distribution's entropy [B, T]."""
  terms = head_terms(model.normed(x_BxTxD, par), model.head(par), targets_BxT, par,
                     vocab_size=model.cfg.vocab_size, chunk=model.cfg.loss_chunk, temperature=temperature,
                     entropy=entropy)
  counted_BxT = targets_BxT >= 0
  logps_BxT = jnp.where(counted_BxT, terms.target - terms.normalizer, 0.0)
  if not entropy:
    return logps_BxT
  return logps_BxT, jnp.where(counted_BxT, terms.normalizer - terms.mean_logit, 0.0)


def _token_terms(model: Any, x_BxTxD: jax.Array, fields: dict[str, jax.Array], par: Parallelism,
                 objective: Callable | None, temperature: float) -> tuple[jax.Array, Any]:
  """The sum of the per-token losses of these tokens, and of the objective's stats (None
  without one): the counted targets' cross-entropy, or ``objective``'s terms (:func:`loss`)."""
  targets_BxT = fields["targets"]
  if objective is None:
    return jnp.sum(jnp.where(targets_BxT >= 0, model.token_losses(x_BxTxD, targets_BxT, par), 0.0)), None
  # An objective that does not read the entropies leaves them out of the compiled step (XLA
  # drops unused values), so they cost only where one does (GRPO's entropy bonus).
  logps_BxT, entropies_BxT = _target_logps(model, x_BxTxD, targets_BxT, par, temperature, entropy=True)
  terms_BxT, stats = objective(logps_BxT, entropies_BxT, fields)
  return jnp.sum(terms_BxT), jax.tree.map(jnp.sum, stats)


def _router_loss(router: moe.RouterStats | None, cfg: Any, sequences: jax.Array, seq_len: int) -> jax.Array:
  if router is None:
    return jnp.zeros((), jnp.float32)
  return moe.router_loss(router, cfg, sequences, seq_len)


def _scaled(loss: jax.Array, scale: jax.Array | None) -> jax.Array:
  return loss if scale is None else loss * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6, 7, 8, 9))
def _manual_loss(graphdef: Any, params: Any, batch: dict[str, jax.Array], scale: jax.Array | None,
                 denominator: jax.Array, sequences: jax.Array, par: Parallelism, logit_max: bool,
                 objective: Callable | None, temperature: float) -> tuple[jax.Array, LossAux]:
  """:func:`loss` in a ``shard_map`` manual over ``pp`` and ``cp`` (those of size > 1; the
  other axes left to the partitioner), with its :class:`LossAux`.

  With pp > 1 the layers run in a pipeline over pp. Embedding, final norm, LM head and
  loss run inside the same ``shard_map``: device 0 embeds each micro-batch as it enters,
  and the last stage's outputs are scattered over pp so that each device computes the
  loss of M/pp micro-batches. With cp > 1 each rank holds T/cp tokens of every sequence
  in ``context``'s balanced layout; the weights stored sharded over cp enter as their cp
  blocks (:func:`_entry_specs`) and are gathered where used, so their gradients leave
  reduce-scattered over cp, as over data-parallel ranks; replicated ones (norm scales)
  leave summed.

  The gradient is taken inside the ``shard_map`` and handed out by this ``custom_vjp``:
  on jax 0.10 differentiating a ``shard_map`` nested in another one (the per-replica
  gradient's, manual over rp) fails to lower, while this form nests at any depth.
  """
  return _manual_call(graphdef, params, batch, scale, denominator, sequences, par, logit_max, objective,
                      temperature, mode="loss")


def _manual_fwd(graphdef, params, batch, scale, denominator, sequences, par, logit_max, objective, temperature):
  return _manual_call(graphdef, params, batch, scale, denominator, sequences, par, logit_max, objective,
                      temperature, mode="grad")


def _manual_bwd(graphdef, par, logit_max, objective, temperature, grads, cotangent):
  del graphdef, par, logit_max, objective, temperature
  # No cotangent for the batch (tokens, and an objective's inputs, which are constants of
  # the step), the loss scale or the counts; the aux outputs have no gradient.
  return jax.tree.map(lambda g: cotangent[0] * g, grads), None, None, None, None


_manual_loss.defvjp(_manual_fwd, _manual_bwd)


def _manual_call(graphdef, params, batch, scale, denominator, sequences, par: Parallelism, logit_max: bool,
                 objective: Callable | None, temperature: float, mode: str):
  """The ``shard_map`` of :func:`_manual_loss`; ``mode`` "loss" (value and aux), "grad"
  (and the gradient), "logps" or "entropy" (:func:`token_logps`: [B, T], out of the
  micro-batches and the balanced layout again; with "entropy" the entropies too)."""
  M, pp, v, cp = par.microbatches, par.pp, par.virtual_stages, par.cp
  B, T = batch["inputs"].shape
  context.check_seq_len(T, cp)
  if B % M:
    raise ValueError(f"batch of {B} sequences does not split into {M} micro-batches;"
                     " choose a batch that the number of micro-batches divides")
  manual = tuple(a for a, n in ((pipeline.AXIS, pp), (context.AXIS, cp)) if n > 1)

  def microbatched(x_BxT):  # micro-batch i = rows i, i + M, ...: keeps the batch sharding
    return context.balance(x_BxT, cp).reshape(B // M, M, T).swapaxes(0, 1)

  entry_specs = _entry_specs(params, manual)

  def forward(params, micro):
    """micro: the batch's leaves [M, b, T/cp] -> the model, the outputs [B', T/cp, D] of
    this device's micro-batches, their per-token fields [B', T/cp], the layers' aux."""
    if pp > 1:
      # Every stage holds the embedding, final norm and LM head, and each device uses them
      # on its own micro-batches: marked as varying over pp where they enter (their fs
      # shards), their gradients are summed over pp there, once, in that layout.
      params = {k: v if k == "blocks" else jax.tree.map(lambda a: jax.lax.pcast(a, pipeline.AXIS, to="varying"), v)
                for k, v in params.items()}
    model = nnx.merge(graphdef, params)
    block_graphdef = nnx.graphdef(model.blocks)
    T_local = T // cp
    fields = _token_fields(micro)

    def extras(i=None):
      """Rotary positions and segment ids of micro-batch i (of all of them when None):
      the packed documents' own, else this rank's positions in the sequence."""
      pick = (lambda a: a.reshape(-1, T_local)) if i is None else (lambda a: a[i])
      positions = pick(micro["positions"]) if "positions" in micro else context.positions(T, cp)
      return positions, pick(micro["segment_ids"]) if "segment_ids" in micro else None

    def run_layers(layers, x, positions, segments):  # -> (x, the layers' aux)
      return apply_layers(block_graphdef, layers, x, rotary_tables(model.cfg, positions), par, model.cfg,
                          segments, logit_max)

    if pp > 1:
      # Every micro-batch embedded before the pipeline, not in the iteration that takes it:
      # the table is gathered over fs once and its gradient reduced once per step.
      b = B // M
      x_BxTxD = model.embed_tokens(micro["inputs"].swapaxes(0, 1).reshape(b * M, T_local), par)
      x_MxbxTxD = x_BxTxD.reshape(b, M, *x_BxTxD.shape[1:]).swapaxes(0, 1)
      outputs, aux_I = pipeline.circular(
          lambda layers, x, i: run_layers(layers, x, *extras(i)), params["blocks"],
          lambda i: x_MxbxTxD[i], M, pp, v, unroll=model.cfg.unroll,
          python_loop=bool(model.cfg.num_experts))
      x_mxbxTxD = pipeline.scatter_from_last(outputs, pp)
      m = M // pp
      fields = {k: jax.lax.dynamic_slice_in_dim(f, jax.lax.axis_index(pipeline.AXIS) * m, m) for k, f in fields.items()}
      x_BxTxD = x_mxbxTxD.reshape(-1, *x_mxbxTxD.shape[2:])
      layer_aux = _per_stage(aux_I, M, pp, v)
    else:
      x_BxTxD, aux_L = run_layers(to_layers(params["blocks"], 1),
                                  model.embed_tokens(micro["inputs"].reshape(-1, T_local), par), *extras())
      layer_aux = jax.tree.map(lambda a: to_stages(a, 1), aux_L)
    return model, x_BxTxD, {k: f.reshape(-1, T_local) for k, f in fields.items()}, layer_aux

  def local_loss(params, micro, scale, denominator, sequences):
    model, x_BxTxD, fields, layer_aux = forward(params, micro)
    total, stats = _token_terms(model, x_BxTxD, fields, par, objective, temperature)
    router = layer_aux.get("router")
    # The router's statistics are already whole over cp (models.moe sums each sequence's
    # over it); the pipeline's stages hold different layers.
    extra = _router_loss(router, model.cfg, sequences, T)
    extra = jax.lax.psum(extra, pipeline.AXIS) if pp > 1 else extra
    value = _scaled(jax.lax.psum(total, manual) / denominator + extra, scale)
    return value, LossAux(layer_aux.get("logit_max"), router, extra, jax.lax.psum(stats, manual))

  def local_logps(params, micro):  # -> [m, b, T/cp] (each), this device's micro-batches
    model, x_BxTxD, fields, _ = forward(params, micro)
    out = _target_logps(model, x_BxTxD, fields["targets"], par, temperature, mode == "entropy")
    return jax.tree.map(lambda x_BxT: x_BxT.reshape(-1, B // M, T // cp), out)

  stages = P(pipeline.AXIS) if pp > 1 else P()
  tokens = P(None, None, context.AXIS) if cp > 1 else P()
  if mode in ("logps", "entropy"):
    out_MxbxT = jax.shard_map(
        local_logps, mesh=jax.sharding.get_abstract_mesh(), in_specs=(entry_specs, tokens),
        out_specs=P(pipeline.AXIS if pp > 1 else None, None, context.AXIS if cp > 1 else None),
        axis_names=set(manual))(params, jax.tree.map(microbatched, batch))
    order = np.argsort(context.token_order(T, cp)) if cp > 1 else slice(None)
    return jax.tree.map(lambda x_MxbxT: x_MxbxT.swapaxes(0, 1).reshape(B, T)[:, order], out_MxbxT)
  aux_specs = LossAux(stages, stages, P(), P())  # a prefix of the aux: None stays None
  return jax.shard_map(
      jax.value_and_grad(local_loss, has_aux=True) if mode == "grad" else local_loss,
      mesh=jax.sharding.get_abstract_mesh(),
      in_specs=(entry_specs, tokens, P(), P(), P()),
      out_specs=((P(), aux_specs), entry_specs) if mode == "grad" else (P(), aux_specs),
      axis_names=set(manual),
  )(params, jax.tree.map(microbatched, batch), scale, denominator, sequences)


def _entry_specs(params: Any, manual: tuple[str, ...]) -> Any:
  """Each parameter's ``in_specs`` entry for a ``shard_map`` manual over ``manual``: the
  leading manual axes of each dimension of its stored layout (``param_specs``). That is
  the stage axis of the layer stack on pp, and the cp blocks of the weights sharded over
  cp (gathered where used: ``Parallelism.weight``); the other axes stay with the
  partitioner (and the embedding's pp part, which is not leading, is gathered on entry)."""

  def leading(entry):
    names = parallel.axis_names(entry)
    k = next((i for i, a in enumerate(names) if a not in manual), len(names))
    return names[0] if k == 1 else (names[:k] or None)

  return jax.tree.map(lambda spec: P(*(leading(e) for e in spec)), param_specs(params),
                      is_leaf=lambda x: isinstance(x, P))


def _per_stage(aux_I: dict[str, Any], M: int, pp: int, v: int) -> dict[str, Any]:
  """The pipeline's per-iteration aux [I, Ls, ...] -> per stage of this device [v, Ls, ...]:
  each iteration's to the stage (repeat) it ran, idle iterations to none; logit maxima
  maxed, router statistics summed over micro-batches."""
  repeat_I, active_I = pipeline.iteration_repeats(M, pp, v)

  def gather(x_I, op, idle):
    active = active_I.reshape(-1, *(1,) * (x_I.ndim - 1))
    out = jnp.full((v, *x_I.shape[1:]), idle, x_I.dtype).at[repeat_I]
    return getattr(out, op)(jnp.where(active, x_I, idle))

  out = {}
  if "logit_max" in aux_I:
    out["logit_max"] = gather(aux_I["logit_max"], "max", -jnp.inf)
  if "router" in aux_I:
    out["router"] = jax.tree.map(lambda x: gather(x, "add", 0.0), aux_I["router"])
  return out
