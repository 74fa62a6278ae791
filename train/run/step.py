"""One optimizer step and one evaluation, jitted on the mesh.

A step: gradients of the mean loss over ``accum`` micro-batches (a scan that sums them:
gradient accumulation when pp == 1; with pp > 1 the pipeline consumes the micro-batches
and ``accum`` is 1; the replicas' gradients are averaged over rp once, after the scan,
as DDP's ``no_sync``), clipping by the global norm, the optimizer's update, and a guard:
when the loss, the gradient norm, the new parameters or the new optimizer state are not
all finite, the step changes nothing (parameters, optimizer state and the schedule's
count come back as they were) and counts as skipped. So a step that would write NaN or
inf anywhere (an lr that overflows float32, a float16 overflow) never does. With
``skip_spikes``, so does a step whose loss or gradient norm spikes (``train/run/spikes.py``).

float16 runs scale the loss dynamically (Megatron's ``--fp16``): the loss is multiplied
by :class:`LossScale`'s ``scale`` before the gradient, so that small gradients of the
float16 backward pass do not flush to zero; the gradient is divided by it again in
float32 before clipping and the optimizer, which see the true gradient. A step whose
scaled gradient overflowed is skipped by the guard and halves the scale; ``window``
clean steps in a row double it.

The loss is the mean over the counted targets of the whole global batch (a target -1,
e.g. a prompt token of fine-tuning data or padding, is not counted): every micro-batch
and every replica divides its sum by the global count, so that their losses and
gradients add up to exactly the global mean however the targets fall.

With a per-token ``objective`` (``models.loss``'s: GRPO's, ``train/grpo/objective.py``) the
loss is the objective's terms summed over the global batch, their weights already its
normalization (no division by the counted targets); its statistics are summed over
micro-batches and replicas like the loss and reported in :class:`StepMetrics`.

With ``offload_optimizer`` the optimizer state lives in pinned host memory between steps
(its arrays' memory kind ``pinned_host``, Megatron's ``--optimizer-cpu-offload`` of the whole
state, MaxText's ``optimizer_memory_host_offload``): the step moves it to the device for the
update and back to the host after it, so that the forward and backward passes, where the
activations peak, run without it on the device. XLA:CPU keeps the step's arguments and
outputs in the host memory space as asked, but lowers the moves inside the step to nothing
(host and device memory are the same RAM there).

A mixture-of-experts model's loss includes its routers' auxiliary losses, averaged over the
global batch's sequences in the same way; their statistics (tokens per expert, drops) are
summed over micro-batches and replicas for the log.

QK-clip (``--qk-clip-threshold``) takes each layer's and head's largest attention logit
from the forward pass (maxed over micro-batches, and over replicas with per-replica
gradients) and shrinks the query and key kernels of the heads above the threshold after
the optimizer's update (``models/qk_clip.py``), inside the guard.

With Dion's compressed sync (rp > 1) its matrices' gradients carry a leading rp axis,
one gradient per replica, and the gradient Dion applies is their mean, which no device
holds. The norm that clipping and the log see is then ``train/run/grad_norm.py``'s: by
default an unbiased estimate of the mean's norm from a sketch of 1024 numbers per
replica (``grad_norm="sketch"``, within about 2% of it), or the replicas' root mean
square (``"rms"``, an upper bound), or the mean's norm itself (``"exact"``, an
all-reduce as large as AdamW's gradient sync). Scaling every replica's gradient by the
same factor scales their mean (docs/design.md §3).

With ``--fp8 delayed`` the state's amax histories (``models/fp8.py``) enter the loss beside
the parameters, and their cotangents are the step's amaxes of each cast tensor: maxed over
the micro-batches and the replicas (never summed), kept out of the gradient that clipping
and the optimizer see, and rolled into the histories when the step applies. A non-finite
amax makes the step non-finite: skipped as the guard skips a NaN loss, so a skipped step
leaves the histories as they were.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import dion_jax
import models
from train.run import grad_norm as grad_norm_lib
from train.run import spikes


class LossScale(NamedTuple):
  """Dynamic loss scaling's state: Megatron's ``DynamicGradScaler`` without hysteresis."""
  scale: jax.Array  # float32: the loss's factor before the gradient; 1 outside float16
  clean: jax.Array  # int32: finite steps in a row since the scale last changed


class Scaling(NamedTuple):
  """Dynamic loss scaling's hyper-parameters (``--loss-scale-window``, ``--min-loss-scale``)."""
  window: int
  min_scale: float


class TrainState(NamedTuple):
  params: Any
  opt_state: Any
  updates: jax.Array  # optimizer updates applied so far (skipped steps excluded): the schedule's count
  loss_scale: LossScale
  spikes: spikes.SpikeWindow | None = None  # the recent losses and gradient norms (None: not kept)
  fp8: Any = None  # --fp8 delayed's amax histories (models.fp8.split_state's; None without): model state, not the optimizer's


class StepMetrics(NamedTuple):
  loss: jax.Array
  grad_norm: jax.Array  # before clipping
  learning_rate: jax.Array
  skipped: jax.Array  # bool: the step changed nothing
  loss_scale: jax.Array  # the scale this step's loss was multiplied by
  max_logit: jax.Array  # the largest attention logit of the step (-inf without QK-clip)
  clipped_heads: jax.Array  # int32: heads QK-clip shrank (0 without it, or when skipped)
  router_loss: jax.Array  # the MoE auxiliary losses' part of ``loss`` (0 without experts)
  expert_load: jax.Array  # the worst MoE layer's max/mean tokens per expert (0 without experts)
  dropped: jax.Array  # share of token-expert assignments over capacity (0 without experts)
  spike: jax.Array  # bool: skipped as a loss or gradient-norm spike (``train/run/spikes.py``)
  objective_stats: Any = None  # the objective's statistics summed over the batch (None without one)


def initial_loss_scale(scale: float) -> LossScale:
  return LossScale(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32))


def next_loss_scale(current: LossScale, finite: jax.Array, scaling: Scaling) -> LossScale:
  """Halved (not below ``min_scale``) after a non-finite step; doubled after ``window``
  finite steps in a row."""
  grow = current.clean + 1 >= scaling.window
  kept = jnp.where(grow, 2 * current.scale, current.scale)
  scale = jnp.where(finite, kept, jnp.maximum(current.scale / 2, scaling.min_scale))
  return LossScale(scale, jnp.where(finite & ~grow, current.clean + 1, 0))


def all_finite(*trees: Any) -> jax.Array:
  """Whether every floating-point element of ``trees`` is finite, as a bool scalar: one
  ``all(isfinite)`` per leaf (as ``optax.apply_if_finite``), then one over the leaves."""
  leaves = [x for x in jax.tree.leaves(trees) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def on_device(tree: Any) -> Any:
  """``tree``'s arrays in device memory, their shardings kept (a copy from pinned host memory)."""
  return jax.device_put(tree, jax.memory.Space.Device)


def on_host(tree: Any) -> Any:
  """``tree``'s arrays in pinned host memory, their shardings kept."""
  return jax.device_put(tree, jax.memory.Space.Host)


def split_micro(batch: dict[str, jax.Array], accum: int) -> dict[str, jax.Array]:
  """[B, T] -> [accum, B / accum, T]; micro-batch i holds rows i, i + accum, ..., so each
  data-parallel shard splits its own rows and the batch sharding carries over."""

  def split(x_BxT):
    B, T = x_BxT.shape
    return x_BxT.reshape(B // accum, accum, T).swapaxes(0, 1)

  return jax.tree.map(split, batch)


def counted(batch: dict[str, jax.Array]) -> jax.Array:
  """The number of counted targets (>= 0) of a global batch, float32, at least 1."""
  return jnp.maximum(jnp.sum(batch["targets"] >= 0), 1).astype(jnp.float32)


def keep_if(ok: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the bool scalar ``ok`` holds, else ``old``, leaf by leaf."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def make_gradient(graphdef: Any, par: models.Parallelism, per_replica: Any | None, accum: int,
                  logit_max: bool = False, objective: Callable | None = None, temperature: float = 1.0
                  ) -> Callable[..., tuple[tuple[jax.Array, models.LossAux], Any]]:
  """``gradient(params, batch, scale, fp8) -> ((loss, aux), grads)``: the mean loss of a
  global batch over ``accum`` micro-batches and its gradients (with ``per_replica``,
  those leaves one per rp replica), ``scale`` the loss's factor (None: 1). With a
  per-token ``objective`` (``models.loss``'s, at ``temperature``) the loss is its terms'
  sum over the global batch. With ``fp8`` (delayed FP8's amax histories) grads is
  ``(params' gradients, amaxes)``, the amaxes shaped as the histories (column 0; the
  cotangents ``models.fp8.delayed_matmul`` gives them), maxed over micro-batches and replicas.

  With rp > 1 every replica sums its micro-batches' gradients unreduced over rp, in a
  ``shard_map`` manual over rp (``dion_jax.parallel.synced_over_replicas``), and the gradients
  are averaged over rp once, after the scan: gradient accumulation does not repeat the
  replicas' all-reduce. The reductions over the axes that shard the parameters (fs, cp,
  ep: ZeRO-3's reduce-scatters) stay in the scan, so the carry is a gradient shard.
  """
  rp = par.size("rp")

  def summed_over_micro(scale, denominator, sequences, delayed):
    """``((loss, models.LossAux), grads)`` of one batch: summed over ``accum`` micro-batches
    (``delayed``: params and grads are pairs, their second halves the histories and amaxes, maxed)."""

    def loss_fn(params, batch):
      return models.loss(graphdef, models.fp8.joined(*params) if delayed else params, batch, par, scale,
                         denominator, sequences, aux=True, logit_max=logit_max, objective=objective,
                         temperature=temperature)

    def accumulated(grads, grads_i):
      if not delayed:
        return jax.tree.map(jnp.add, grads, grads_i)
      return jax.tree.map(jnp.add, grads[0], grads_i[0]), jax.tree.map(jnp.maximum, grads[1], grads_i[1])

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum == 1:
      return grad_fn

    def summed(params, batch):
      def add(total, batch_i):
        ((loss, aux), grads), ((loss_i, aux_i), grads_i) = total, grad_fn(params, batch_i)
        return ((loss + loss_i, _merge(aux, aux_i)), accumulated(grads, grads_i)), None

      micro = split_micro(batch, accum)
      first = jax.tree.map(lambda x: x[0], micro)
      # Inside the replicas' shard_map the sums vary over rp: so must the scan's carry.
      manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
      zeros = lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), manual, to="varying")  # noqa: E731
      (loss0, aux0), grads0 = jax.tree.map(zeros, jax.eval_shape(grad_fn, params, first))
      if logit_max:
        aux0 = aux0._replace(logit_max=jnp.full_like(aux0.logit_max, -jnp.inf))
      return jax.lax.scan(add, ((loss0, aux0), grads0), micro)[0]

    return summed

  def gradient(params, batch, scale=None, fp8=None):
    # With replicas, each divides by its share: the replicas' losses are averaged.
    denominator = jnp.float32(1) if objective is not None else counted(batch)
    delayed = fp8 is not None
    grad_fn = summed_over_micro(scale, denominator / rp, batch["inputs"].shape[0] / rp, delayed)
    # A replica's gradient is rp times one device's (its loss is its share's mean), a float16
    # one the loss scale's times: its histories are read, and its amaxes kept, in one device's units.
    factor = jnp.float32(rp) * (1 if scale is None else scale)
    inputs = (params, models.fp8.gradient_rows_scaled(fp8, factor)) if delayed else params
    if rp == 1:
      (loss, aux), grads = grad_fn(inputs, batch)
      return (loss, aux), (grads[0], models.fp8.gradient_rows_scaled(grads[1], 1 / factor)) if delayed else grads
    keep = jax.tree.map(lambda _: False, params) if per_replica is None else per_replica
    # Each replica's amaxes come back one per replica (not averaged) and are maxed here.
    keep = (keep, jax.tree.map(lambda _: True, fp8)) if delayed else keep
    synced = dion_jax.parallel.synced_over_replicas(grad_fn, par.mesh, keep, has_aux=True)
    (loss, aux), grads = synced(inputs, batch)
    if delayed:
      grads = grads[0], models.fp8.gradient_rows_scaled(jax.tree.map(lambda a: jnp.max(a, axis=0), grads[1]), 1 / factor)
    return (loss, _merge(*(jax.tree.map(lambda a, i=i: a[i], aux) for i in range(rp)), replicas=rp)), grads

  return gradient


def make_train_step(graphdef: Any, par: models.Parallelism, tx: optax.GradientTransformation,
                    lr_schedule: optax.Schedule, per_replica: Any | None, accum: int,
                    clip_grad: float, scaling: Scaling | None = None,
                    qk_clip: tuple[float, models.GPTConfig] | None = None, skip_spikes: float = 0.0,
                    objective: Callable | None = None, temperature: float = 1.0,
                    grad_norm: str = grad_norm_lib.NORMS[0], sketch_size: int = grad_norm_lib.SKETCH_SIZE,
                    offload_optimizer: bool = False) -> Callable[[TrainState, dict], tuple[TrainState, StepMetrics]]:
  """The jitted step; ``scaling`` None leaves the loss unscaled (the state's scale unused);
  ``qk_clip`` is (threshold, the model's config) or None; ``skip_spikes`` > 0 skips a step
  whose loss or gradient norm is that many standard deviations above the state's window
  (``train/run/spikes.py``; the state must keep one), 0 applies it; ``objective`` a per-token
  objective of ``models.loss`` (at ``temperature``) in place of the cross-entropy;
  ``grad_norm`` "sketch" (of ``sketch_size`` numbers per replica), "rms" or "exact": the
  norm of per-replica gradients (``train/run/grad_norm.py``); ``offload_optimizer``: the
  state's optimizer state is in pinned host memory, and so is the new one (module
  docstring)."""
  if grad_norm not in grad_norm_lib.NORMS:
    raise ValueError(f"grad_norm {grad_norm!r}: choose one of {', '.join(grad_norm_lib.NORMS)}")
  logit_max = qk_clip is not None
  mean_grads = make_gradient(graphdef, par, per_replica, accum, logit_max, objective, temperature)

  def step(state: TrainState, batch: dict) -> tuple[TrainState, StepMetrics]:
    scale = state.loss_scale.scale if scaling else None
    (loss, aux), grads = mean_grads(state.params, batch, scale, state.fp8)
    amaxes = None
    if state.fp8 is not None:  # delayed FP8: this step's amaxes, apart from the gradient
      grads, amaxes = grads[0], jax.tree.map(lambda a: a[..., 0], grads[1])
    if scaling:
      loss, grads = jax.tree.map(lambda x: x / scale, (loss, grads))
    norm = grad_norm_lib.global_norm(grads, per_replica, grad_norm, sketch_size, state.updates, par.mesh,
                                     models.param_specs(state.params))
    if clip_grad > 0:
      factor = jnp.minimum(1.0, clip_grad / jnp.maximum(norm, 1e-30))
      grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
    old_opt_state = on_device(state.opt_state) if offload_optimizer else state.opt_state
    updates, opt_state = tx.update(grads, old_opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    clipped, max_logit = jnp.zeros((), jnp.int32), jnp.asarray(-jnp.inf, jnp.float32)
    if logit_max:
      params, clipped = models.qk_clip.qk_clip(params, aux.logit_max, *qk_clip)
      max_logit = jnp.max(aux.logit_max)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    if amaxes is not None:  # an overflow the FP8 casts saturated, unseen by the loss
      finite &= all_finite(amaxes)
    spike = spikes.is_spike(state.spikes, loss, norm, skip_spikes) if skip_spikes else jnp.zeros((), bool)
    applied = finite & ~spike if skip_spikes else finite
    params, opt_state = keep_if(applied, (params, opt_state), (state.params, old_opt_state))
    # A second select for the new state's own check: folding it into the first changes how
    # XLA fuses the update, and float32 results by an ulp from step 3. Measured on CPU
    # (tiny, one device): step time and temporary memory unchanged within noise.
    finite &= all_finite(params, opt_state)
    applied = finite & ~spike if skip_spikes else finite
    params, opt_state = keep_if(applied, (params, opt_state), (state.params, old_opt_state))
    fp8 = state.fp8 if amaxes is None else keep_if(
        applied, jax.tree.map(models.fp8.updated_history, state.fp8, amaxes), state.fp8)
    new = TrainState(params, on_host(opt_state) if offload_optimizer else opt_state, state.updates + applied.astype(state.updates.dtype),
                     next_loss_scale(state.loss_scale, finite, scaling) if scaling else state.loss_scale,
                     None if state.spikes is None else spikes.record(state.spikes, loss, norm), fp8)
    routing = (jnp.zeros(()), jnp.zeros(())) if aux.router is None else _routing(aux.router)
    return new, StepMetrics(loss, norm, lr_schedule(state.updates), ~applied, state.loss_scale.scale, max_logit,
                            jnp.where(applied, clipped, 0), aux.router_loss, *routing, spike, aux.stats)

  return jax.jit(step, donate_argnums=0)


def _merge(a: models.LossAux, *rest: models.LossAux, replicas: int = 1) -> models.LossAux:
  """LossAux of several micro-batches or replicas: logit maxima maxed, router statistics
  summed, router losses summed (each already its share of the global mean; replicas'
  shares are averaged, as their losses are), an objective's statistics summed (each
  already weighted for the global batch)."""
  add = lambda x, y: None if x is None else jax.tree.map(jnp.add, x, y)  # noqa: E731
  for b in rest:
    a = models.LossAux(None if a.logit_max is None else jnp.maximum(a.logit_max, b.logit_max),
                       add(a.router, b.router), a.router_loss + b.router_loss, add(a.stats, b.stats))
  return a._replace(router_loss=a.router_loss / replicas)


def _routing(router: models.moe.RouterStats) -> tuple[jax.Array, jax.Array]:
  """The worst layer's max/mean tokens per expert, and the share of assignments dropped."""
  load_LxE = router.load.reshape(-1, router.load.shape[-1])
  imbalance = jnp.max(load_LxE.max(-1) / jnp.maximum(load_LxE.mean(-1), 1e-9))
  return imbalance, jnp.sum(router.dropped) / jnp.maximum(jnp.sum(router.load), 1.0)


def make_eval_step(graphdef: Any, par: models.Parallelism, accum: int) -> Callable[[Any, dict], jax.Array]:
  """The summed loss of a global batch over its counted targets (float32; the caller
  divides, ``train/run/evaluation.py``), micro-batch by micro-batch like the train step; the
  language-model loss only (a MoE's auxiliary losses left out)."""

  def lm_loss_sum(params, batch):
    loss, aux = models.loss(graphdef, params, batch, par, denominator=jnp.float32(1), aux=True)
    return loss - aux.router_loss

  def loss_fn(params, batch):
    if accum == 1:
      return lm_loss_sum(params, batch)
    return jnp.sum(jax.lax.map(lambda b: lm_loss_sum(params, b), split_micro(batch, accum)))

  return jax.jit(loss_fn)
