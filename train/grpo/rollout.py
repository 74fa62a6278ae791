"""GRPO's rollouts: sampling a step's completions from the policy, their rewards and
advantages, the rollout policy's (and the reference's) log-probabilities, and the update
batch the trainer's step takes (``train/grpo/batch.py``).

With ``--fp8 delayed`` every forward pass of a rollout casts with the amax histories of the
trainer's state, the scales the next update's forward casts with (:func:`policy`; read,
never written: only an applied update records amaxes, ``train/run/step.py``): the sampler,
the rollout policy's log-probabilities and the reference's (its own parameters, the
policy's scales: a reference equal to the policy gives a KL of exactly 0).
``docs/fp8.md`` says why."""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models import generate
from train.grpo import batch as grpo_batch
from train.grpo import objective as grpo_objective
from train.grpo import rewards as grpo_rewards
from train.grpo.config import GRPOConfig
from train.run import hosts
from train.run import step as step_lib
from train.run.setup import Run


class Prompts(NamedTuple):
  """GRPO's own part of a run (``Run.data``)."""
  grpo: GRPOConfig
  rows: list[dict]
  texts: list[str]  # each row's prompt as the rewards see it
  tokens: list[np.ndarray]
  tokenizer: Any
  rewards: list[tuple[str, Callable, float]]
  objective: grpo_objective.Objective
  graphdef: Any  # the policy's and the reference's (with --fp8 delayed, its products hold amax histories)
  reference: Any | None  # the starting policy's parameters (with --beta > 0)
  first: Rollout | None  # the first step's rollout, made in set-up to score and compile
  rows_unit: int  # the update's rows split over the data-parallel ranks and micro-batches: a multiple of this
  entropy_control: grpo_objective.EntropyControl  # the entropy bonus's at the start (a resumed run's saved one)


class Rollout(NamedTuple):
  """One step's completions, their rewards and the update batch."""
  batch: dict  # grpo_batch.update_batch's
  layout: grpo_batch.Layout  # the completions, each after its prompt, in the update's rows
  mask_BxM: np.ndarray  # 1 on the completion tokens
  old_BxM: jax.Array  # the rollout policy's log-probabilities
  ref_BxM: jax.Array | None  # the reference's (with --beta > 0)
  rewards_BxR: np.ndarray
  advantages_B: np.ndarray
  lengths_B: np.ndarray
  ended_B: np.ndarray  # the completion ends with eos
  entropy: float | None  # mean over the completion tokens (with --top-entropy-quantile < 1)
  logp_difference: tuple[float, float]  # mean and max of |the sampler's − old_BxM| over the completion tokens
  seconds: float  # sampling, scoring and the log-probabilities



def policy(state: step_lib.TrainState, params: Any | None = None) -> Any:
  """The model the trainer's ``state`` computes: its parameters (or ``params``, the
  reference's), joined with ``--fp8 delayed``'s amax histories (module docstring)."""
  return models.fp8.joined(state.params if params is None else params, state.fp8)


def rollout(run: Run, state: step_lib.TrainState, step: int) -> Rollout:
  """Step ``step``'s rollout from the policy of the trainer's ``state``: the prompts,
  completions, rewards, advantages, the rollout policy's (and reference's)
  log-probabilities, the update batch."""
  p, grpo = run.data, run.data.grpo
  G, M = grpo.group_size, grpo.max_new_tokens
  t0 = time.perf_counter()
  order = np.random.default_rng(grpo.seed).permutation(len(p.rows))
  picks = [order[((step - 1) * grpo.prompts_per_step + j) % len(p.rows)] for j in range(grpo.prompts_per_step)]
  batch_sharding = NamedSharding(run.mesh, P(models.BATCH_AXES))
  params = policy(state)
  with jax.set_mesh(run.mesh):
    out = generate.complete(p.graphdef, generate.rollout_params(params, run.par), [p.tokens[i] for i in picks], M,
                            generate.Sampling(grpo.temperature, grpo.top_k, grpo.top_p),
                            seed=grpo.seed * 1_000_003 + step, eos_id=p.tokenizer.eod, group_size=G,
                            batch_sharding=batch_sharding)
  completions_BxM, lengths_B = hosts.fetch(out.tokens_BxM), hosts.fetch(out.lengths_B)
  ended_B = np.asarray([n > 0 and row[n - 1] == p.tokenizer.eod for row, n in zip(completions_BxM, lengths_B)])
  rewards_BxR = _score(p, picks, completions_BxM, lengths_B, ended_B, hosts.row_owners(batch_sharding, len(lengths_B)))
  advantages_B = np.asarray(grpo_objective.advantages(
      jnp.asarray(rewards_BxR, jnp.float32), jnp.asarray([w for _, _, w in p.rewards], jnp.float32), G,
      grpo.scale_rewards, grpo.multi_objective_aggregation))
  layout = _layout(run, [p.tokens[i] for i in picks for _ in range(G)], completions_BxM, lengths_B)
  mask_BxM = (np.arange(M)[None] < lengths_B[:, None]).astype(np.float32)
  old_BxM, keep_BxM, entropy = logps_and_keep(run, state, layout, mask_BxM)
  ref_BxM = None if p.reference is None else _logps(run, policy(state, p.reference), layout)
  with jax.set_mesh(run.mesh):
    difference = tuple(map(float, _logp_difference(out.logprobs_BxM, old_BxM, jnp.asarray(mask_BxM))))
  made = Rollout(None, layout, mask_BxM, old_BxM, ref_BxM, rewards_BxR, advantages_B, lengths_B, ended_B, entropy,
                 difference, 0.0)
  return made._replace(batch=update_batch(run, made, keep_BxM), seconds=time.perf_counter() - t0)


@jax.jit
def _logp_difference(sampled_BxM: jax.Array, old_BxM: jax.Array, mask_BxM: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The mean and the max over the completion tokens of |the sampler's log-probability − the
  log-probability pass's| (TRL's ``sampling/sampling_logp_difference``): what the sampler's
  program (one token at a time, from a key/value cache) leaves off the policy's forward."""
  difference_BxM = jnp.abs(sampled_BxM - old_BxM) * mask_BxM
  return jnp.sum(difference_BxM) / jnp.maximum(jnp.sum(mask_BxM), 1), jnp.max(difference_BxM)


def _layout(run: Run, prompts: list[np.ndarray], completions_BxM: np.ndarray, lengths_B: np.ndarray
            ) -> grpo_batch.Layout:
  """The update's rows (``train/grpo/batch.py``): packed, or with --no-pack one completion
  to a row; their length a multiple of cp's 2·cp chunks."""
  multiple = 2 * run.par.cp
  if run.data.grpo.pack:
    return grpo_batch.packed(prompts, completions_BxM, lengths_B, run.model_cfg.seq_len, run.data.rows_unit,
                             multiple)
  return grpo_batch.padded(prompts, completions_BxM, lengths_B, multiple)


def _score(p: Prompts, picks: list[int], completions_BxM: np.ndarray, lengths_B: np.ndarray, ended_B: np.ndarray,
           owners_B: np.ndarray) -> np.ndarray:
  """The rewards [B, R]. Each process decodes and scores the completions it owns, those its
  devices sampled (``train/run/hosts.py``): the reward functions see this process's strings
  only. The rewards, numbers, are then gathered, so that every process takes the advantages
  over whole groups and the whole rollout, wherever a group's completions were sampled."""
  G = p.grpo.group_size
  mine = np.flatnonzero(owners_B == jax.process_index())
  texts = [p.tokenizer.decode(completions_BxM[b, :lengths_B[b] - int(ended_B[b])]) for b in mine]
  rows = [picks[b // G] for b in mine]
  rewards_BxR = np.zeros((len(owners_B), len(p.rewards)))
  rewards_BxR[mine] = grpo_rewards.score(p.rewards, [p.rows[i] for i in rows], [p.texts[i] for i in rows], texts)
  return hosts.gather_rows(rewards_BxR, owners_B)


def update_batch(run: Run, made: Rollout, keep_BxM: jax.Array | None) -> dict:
  """The rollout's update batch (``grpo_batch.update_batch``), split over the batch axes;
  the entropy bonus's coefficient is set for each update (:func:`_updates`)."""
  with jax.set_mesh(run.mesh):
    batch = _jitted_update_batch(made.layout, made.old_BxM, made.ref_BxM, jnp.asarray(made.advantages_B),
                                 jnp.asarray(made.mask_BxM), run.data.objective, jnp.float32(made.mask_BxM.sum()),
                                 keep_BxM)
    return jax.device_put(batch, NamedSharding(run.mesh, P(models.BATCH_AXES)))


@functools.partial(jax.jit, static_argnames="objective")
def _jitted_update_batch(layout, old_BxM, ref_BxM, advantages_B, mask_BxM, objective, num_items, keep_BxM):
  return grpo_batch.update_batch(layout, grpo_objective.per_token_fields(old_BxM, ref_BxM, advantages_B, mask_BxM,
                                                                         objective, num_items, keep_BxM))


def _logps(run: Run, params: Any, layout: grpo_batch.Layout, entropy: bool = False) -> Any:
  with jax.set_mesh(run.mesh):
    return _token_logps(run.data.graphdef, params, layout, run.data.grpo.temperature, run.par, entropy)


_token_logps = jax.jit(grpo_batch.token_logps, static_argnums=(0, 3, 4, 5))


def logps_and_keep(run: Run, state: step_lib.TrainState, layout: grpo_batch.Layout, mask_BxM: np.ndarray
                    ) -> tuple[jax.Array, jax.Array | None, float | None]:
  """The completion tokens' log-probabilities under the policy of the trainer's ``state``
  [B, M]; with ``--top-entropy-quantile`` < 1 also the high-entropy mask and the mean entropy."""
  quantile = run.data.grpo.top_entropy_quantile
  if quantile >= 1:
    return _logps(run, policy(state), layout), None, None
  logps_BxM, entropies_BxM = _logps(run, policy(state), layout, entropy=True)
  keep_BxM = grpo_objective.high_entropy_mask(entropies_BxM, jnp.asarray(mask_BxM), quantile)
  return logps_BxM, keep_BxM, float(jnp.sum(entropies_BxM * mask_BxM) / max(mask_BxM.sum(), 1))

