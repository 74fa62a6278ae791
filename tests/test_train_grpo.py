"""python -m train.grpo: the policy's log-probabilities under left padding, the built-in
rewards, a short run that train.sample reads back, bad input, two processes against one
(and process 0's death), and the config file."""
import dataclasses
import functools
import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import dion_jax
import models
from tests.test_train_gpt import compile_cache, free_port, subprocess_env  # noqa: F401  a fixture
from tests.test_train_gpt import assert_trees_equal, saved_state
from tests import saved_runs
from tests.test_train_run_peers import wait_for_step
from train import sample
from train.grpo import __main__ as grpo
from train.grpo import batch as grpo_batch
from train.grpo import config as grpo_config
from train.grpo import loop as grpo_loop
from train.grpo import objective as grpo_objective
from train.grpo import rollout as rollout_lib
from train.run import config as config_lib
from train.run import loop, setup
from train.run import restore as restore_lib
from train.store import checkpoint as ckpt_lib

SEQ_LEN = 32
TEMPERATURE = 0.7


def digits_reward(prompts, completions, **_):
  """The share of a completion's characters that are digits (varies within a group)."""
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def raising_reward(prompts, completions, **_):
  raise RuntimeError("no score today")


def nan_reward(prompts, completions, **_):
  return [math.nan] * len(completions)


LOCKS_SEEN = []  # the run directory's lock file, as a reward finds it during a run (WATCHED_RUN)
WATCHED_RUN = []


def lock_watcher(prompts, completions, **_):
  path = os.path.join(WATCHED_RUN[-1], "run.lock")
  with open(path) if os.path.exists(path) else open(os.devnull) as f:
    LOCKS_SEEN.append(json.loads(f.read() or "null"))
  return [0.0] * len(completions)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  """A byte-level GPT saved as a train.gpt run (config.json and an Orbax checkpoint of its
  parameters), without training it."""
  cfg = models.preset("tiny", num_layers=2, d_model=32, num_heads=2, seq_len=SEQ_LEN)
  return saved_runs.save(str(tmp_path_factory.mktemp("grpo") / "base"), cfg, models.init(cfg, seed=0)[1],
                         config_lib.Config(num_layers=2, hidden_size=32, num_attention_heads=2, seq_len=SEQ_LEN,
                                           optimizer="adamw"))


@pytest.fixture
def prompts_file(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                          for p, a in [("1+2=", "3"), ("40+4=", "44"), ("12+7=", "19")]))
  return str(path)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_token_logps_are_the_full_forwards(base_run, layout):
  """Prompts and completions in the update's rows (packed several to a row, or one to a
  row, left-padded) through the training forward: each completion token's log
  softmax(logits / T), and the entropy of that distribution, equal the sequence's alone
  (sample.logits, float64); 0 past a completion's end."""
  restored = restore_lib.restore(base_run)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (4, 9, 2)]
  lengths_B = np.asarray([5, 3, 5])
  completions_BxM = rng.integers(0, 256, (3, 5)).astype(np.int32)
  made = (grpo_batch.packed(prompts, completions_BxM, lengths_B, SEQ_LEN) if layout == "packed" else
          grpo_batch.padded(prompts, completions_BxM, lengths_B))
  if layout == "packed":
    assert made.batch["inputs"].shape == (2, 21)  # rows of 16 + 5: the 11 and 8 inputs share one
  staged = dict(restored.params, blocks=models.to_stages(restored.params["blocks"], 1))
  got, entropies = map(np.asarray, grpo_batch.token_logps(restored.graphdef, staged, made, TEMPERATURE, entropy=True))
  for b, (prompt, n) in enumerate(zip(prompts, lengths_B)):
    s = np.concatenate([prompt, completions_BxM[b, :n]])
    logits_TxV = np.asarray(sample.logits(restored.graphdef, restored.params, s[None]), np.float64)[0, :, :restored.cfg.vocab_size]
    z = logits_TxV / TEMPERATURE
    logsoftmax = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    predicting = logsoftmax[len(prompt) - 1:len(s) - 1]
    np.testing.assert_allclose(got[b, :n], predicting[np.arange(n), s[len(prompt):]], atol=2e-5)
    np.testing.assert_allclose(entropies[b, :n], -np.sum(np.exp(predicting) * predicting, -1), atol=2e-5)
    assert not got[b, n:].any() and not entropies[b, n:].any()


def test_run_writes_metrics_and_a_checkpoint_train_sample_reads(base_run, prompts_file, tmp_path):
  """Two steps with Dion on fs=2,tp=2 and TRL's newer options (SAPO, GSPO, the high-entropy
  mask, GDPO's normalization): finite metrics, a policy that moved, a checkpoint train.sample
  restores on one device."""
  run_dir = str(tmp_path / "grpo")
  args = ["--init-from", base_run, "--prompts", prompts_file, "--run-dir", run_dir, "--steps", "2",
          "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--beta", "0.04",
          "--updates-per-rollout", "2", "--lr", "1e-2", "--reward", "tests.test_train_grpo:digits_reward",
          "--reward", "format=0.5", "--optimizer", "dion", "--mesh", "fs=2,tp=2", "--loss-type", "sapo",
          "--importance-sampling-level", "sequence", "--top-entropy-quantile", "0.5",
          "--multi-objective-aggregation", "normalize_then_sum"]
  assert grpo.main(args) == 0
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert all(math.isfinite(v) for v in r.values()), r
    assert 1 <= r["completion_length_mean"] <= r["completion_length_max"] <= 6
    assert r["reward/tests.test_train_grpo:digits_reward/std"] >= 0
  assert records[1]["kl"] > 0  # the policy moved away from the reference after step 1's updates
  trained = restore_lib.restore(run_dir)
  start = restore_lib.restore(base_run)
  assert trained.step == 2
  assert not np.allclose(trained.params["lm_head"]["kernel"], start.params["lm_head"]["kernel"])
  assert sample.main([run_dir, "--prompt", "1+2=", "--max-new-tokens", "4"]) == 0


@pytest.mark.parametrize("extra, message", [
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--reward", "no_such_module_xyz:f"], "cannot load no_such_module_xyz:f"),
    (["--prompts", "{empty}"], "holds no prompts"),
    (["--prompts", "{empty}.absent"], "empty.jsonl.absent does not exist; pass a JSONL or Parquet file"),
    # this process's own inputs are checked before it waits for the others (once: 300 s)
    (["--init-from", "{empty}.run", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
     "empty.jsonl.run does not exist; name the directory of a python -m train.gpt run"),
    (["--max-new-tokens", "30"], "the prompt has 4 tokens; it must have 1 to 2"),
    (["--max-new-tokens", "32"], "leaves no room for a prompt in the model's seq_len 32 (--init-from"),
    (["--temperature", "0"], "--temperature must be a finite number > 0"),
    (["--reward", "tests.test_train_grpo:raising_reward"], "raised RuntimeError: no score today"),
    (["--reward", "tests.test_train_grpo:nan_reward"], "must return one finite number per completion"),
    (["--mesh", "pp=2", "--prompts-per-step", "1", "--group-size", "3"], "into pp=2 micro-batches"),
    (["--mesh", "fs=3"], "the 8 completions of a step (--prompts-per-step x --group-size) split over 3"),
    (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile must be in [0, 1]"),
    (["--delta", "0.9"], "--delta must be > 1"),
    (["--off-policy-mask-threshold", "0"], "--off-policy-mask-threshold must be positive"),
    (["--loss-type", "vespo", "--vespo-k-neg", "-1"], "--vespo-k-neg must be >= 0, got -1.0"),
    (["--use-adaptive-entropy", "--entropy-coef-max", "0.01", "--entropy-coef-min", "0.1"],
     "--entropy-coef-max 0.01 is below --entropy-coef-min 0.1"),
    (["--prompt-column", "question"], "row 1 has no --prompt-column 'question' text"),
    (["--reward", "answer", "--answer-column", "final"], "row 1 has no --answer-column 'final'"),
    # The optimizer's flags are train.gpt's, with its checks.
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 exceeds the peak --lr 0.1"),
    (["--lr-decay-style", "steep"], "argument --lr-decay-style: invalid choice: 'steep'"),
    # The multi-host flags and config files are train.gpt's too.
    (["--coordinator", "127.0.0.1"], "--coordinator 127.0.0.1: expected HOST:PORT"),
    (["--num-processes", "2"], "multi-host runs need all of --coordinator HOST:PORT, --num-processes"),
    (["--config", "{config}"], "unknown key 'learning_rate'; the keys are python -m train.grpo's flags"),
    (["--config", "{config}", "--print-config"], "unknown key 'learning_rate'"),
])
def test_bad_input(base_run, prompts_file, tmp_path, capsys, extra, message):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  config = tmp_path / "run.yaml"
  config.write_text("group_size: 4\nlearning_rate: 0.1\n")
  run_dir = str(tmp_path / "run")
  args = ["--init-from", base_run, "--prompts", prompts_file, "--run-dir", run_dir, "--steps", "1",
          "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--reward", "format",
          "--mesh", "fs=2,tp=2"]  # the run test's mesh and shapes: its compiled rollout serves
  assert grpo.main(args + [a.format(empty=str(empty), config=str(config)) for a in extra]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
  assert not os.path.exists(run_dir)  # nothing half-written


REFERENCE_AS_POLICY = []  # a rollout's reference log-probabilities, and the policy's pass on the reference's parameters


def reference_as_policy(rollout, run, state, step):
  """``rollout``'s, which also puts its reference's log-probabilities and those of the
  policy's pass on the reference's parameters in REFERENCE_AS_POLICY."""
  made = rollout(run, state, step)
  if made.ref_BxM is not None:
    as_policy = rollout_lib.logps_and_keep(run, state._replace(params=run.data.reference), made.layout, made.mask_BxM)
    REFERENCE_AS_POLICY.append((made.ref_BxM, as_policy[0]))
  return made


def test_resume_continues_as_if_never_stopped_and_a_mesh_as_one_device(base_run, prompts_file, tmp_path, capsys,
                                                                       monkeypatch):
  """One step, then --resume to step 2 with no other flags: the saved flags are reloaded,
  and the second step's rollout, rewards, loss and the final state are those of a run of
  two steps straight, bit for bit (one device, KL on, so the reference is restored too; the
  adaptive entropy bonus, whose coefficient step 1 raised and step 2 applies, so its control
  is restored too; --fp8 delayed, so the amax histories step 1 wrote are restored and step
  2's sampler, log-probabilities and update cast with them). The same two steps on
  fs=2,tp=2 give one device's metrics and histories within float32 rounding. A flag
  that differs from the saved run's is refused; the run holds its directory's lock while it
  steps and lets it go at the end."""
  args = ["--init-from", base_run, "--prompts", prompts_file, "--prompts-per-step", "2", "--group-size", "4",
          "--max-new-tokens", "6", "--beta", "0.04", "--lr", "1e-2", "--save-every", "1", "--mesh", "fs=1",
          "--optimizer", "adamw", "--lr-decay-style", "constant", "--lr-warmup-steps", "0",
          "--reward", "tests.test_train_grpo:digits_reward", "--reward", "tests.test_train_grpo:lock_watcher=0",
          "--use-adaptive-entropy", "--entropy-target", "10", "--entropy-coef-delta", "0.05", "--fp8", "delayed"]
  straight, stopped, mesh = str(tmp_path / "straight"), str(tmp_path / "stopped"), str(tmp_path / "mesh")
  WATCHED_RUN.append(straight)
  monkeypatch.setattr(rollout_lib, "rollout", functools.partial(reference_as_policy, rollout_lib.rollout))
  assert grpo.main([*args, "--run-dir", straight, "--steps", "2"]) == 0
  monkeypatch.undo()
  # The reference scores with the policy's histories: were it the policy, its
  # log-probabilities would be the policy's bit for bit (a KL of exactly 0).
  np.testing.assert_array_equal(*REFERENCE_AS_POLICY[-1])
  out = capsys.readouterr().out.splitlines()
  lines = [i for i, line in enumerate(out) if re.match(r"step +\d+/2 \|", line)]
  assert len(lines) == 2 and out.index(grpo_loop.LEGEND) < lines[0], out  # the fields said once, first
  # Step 1's rollout is scored in set-up, before the run takes the directory (as train.gpt
  # compiles its step first): a bad reward is refused with nothing written.
  assert LOCKS_SEEN[-2:] == [None, {"host": socket.gethostname(), "pid": os.getpid()}]
  assert not os.path.exists(os.path.join(straight, "run.lock"))
  WATCHED_RUN.append(stopped)
  assert grpo.main([*args, "--run-dir", stopped, "--steps", "1"]) == 0
  assert grpo.main(["--run-dir", stopped, "--steps", "2", "--resume", "--lr", "0.5"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--resume --lr 0.5: the run was saved with 0.01" in err[0], err
  assert grpo.main(["--run-dir", stopped, "--resume"]) == 2  # the saved --steps 1 is reached
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "its checkpoint at step 1 reaches --steps 1" in err[0], err
  assert grpo.main(["--run-dir", stopped, "--steps", "2", "--resume", "--lr", "1e-2"]) == 0
  WATCHED_RUN.append(mesh)
  assert grpo.main([*args, "--run-dir", mesh, "--steps", "2", "--mesh", "fs=2,tp=2"]) == 0
  records = {run_dir: strict_records(run_dir) for run_dir in (straight, stopped, mesh)}
  assert [r["step"] for r in records[stopped]] == [1, 2]
  assert [r["entropy_coef"] for r in records[stopped]] == pytest.approx([0.05, 0.1])
  # The sampler takes one token at a time: step 1's empty histories scale each of its
  # products by that token's own amax, not the whole rows' as the log-probabilities' pass
  # does (0.1 apart, as --fp8 current always is); from step 2 both cast with the histories.
  difference = [r["sampling/sampling_logp_difference/max"] for r in records[straight]]
  assert difference[0] > 1e-2 and difference[1] < 1e-5, difference
  timing = ("rollout_s", "train_s", "rollout_tokens_per_s", "train_tokens_per_s")
  for run_dir in (stopped, mesh):
    for a, b in zip(records[straight], records[run_dir]):
      assert {k: v for k, v in b.items() if k not in timing} == pytest.approx(
          {k: v for k, v in a.items() if k not in timing}, abs=1e-6), run_dir
  state = saved_state(straight)
  assert_trees_equal(saved_state(stopped), state)
  first = saved_state(straight, 1)["fp8"]
  on_mesh = saved_state(mesh)["fp8"]
  for h1, h2, m in zip(jax.tree.leaves(first), jax.tree.leaves(state["fp8"]), jax.tree.leaves(on_mesh)):
    assert np.all(h1[..., 0] > 0) and not np.any(h1[..., 1:])  # step 1's amaxes
    np.testing.assert_array_equal(h2[..., -1], h1[..., 0])  # rolled (flax's order), step 2's in front
    assert not np.any(h2[..., 1:-1])
    assert np.all(h2[..., 0] > 0) and not np.allclose(h2[..., 0], h1[..., 0], rtol=1e-3)
    np.testing.assert_allclose(m, h2, rtol=1e-5)
  assert grpo.main(["--run-dir", stopped, "--resume"]) == 2  # the resumed run saved its --steps 2
  assert "its checkpoint at step 2 reaches --steps 2" in capsys.readouterr().err
  # The starting run's checkpoint damaged (its data files truncated): one line, naming no --step,
  # which would pick the resumed run's own step.
  start = os.path.join(base_run, "checkpoints")
  intact = {path: open(path, "rb").read() for path in glob.glob(os.path.join(start, "1", "state", "**", "d", "*"),
                                                                 recursive=True)}
  try:
    for path, data in intact.items():
      with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    assert grpo.main(["--run-dir", stopped, "--resume", "--steps", "3"]) == 2
  finally:
    for path, data in intact.items():
      with open(path, "wb") as f:
        f.write(data)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: the checkpoint of step 1 in {start} is damaged"), err
  assert "--step" not in err[0] and err[0].endswith(f"from another --init-from ({start} has no older checkpoint)")


def test_a_run_directory_in_use_is_refused(base_run, prompts_file, tmp_path, capsys):
  """A live process's lock in --run-dir: refused with one line before anything is written."""
  run_dir = tmp_path / "busy"
  run_dir.mkdir()
  (run_dir / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
  args = ["--init-from", base_run, "--prompts", prompts_file, "--run-dir", str(run_dir), "--steps", "1",
          "--reward", "format"]
  assert grpo.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is in use by another run (pid" in err[0], err
  assert os.listdir(run_dir) == ["run.lock"]


# Per case, the loss's terms and the objective of the batch's weights: the aggregation enters
# by the weights alone (grpo_objective.per_token_fields), so one compiled loss serves grpo and
# dr_grpo; GSPO's sequence-level ratio, OPSM and VESPO's weight are sums over each completion's
# tokens (over cp too) in the terms; the entropy bonus differentiates the policy's entropies.
TOKEN_TERMS = grpo_objective.Objective(beta=0.04, sequences=8)
SEQUENCE_TERMS = dataclasses.replace(TOKEN_TERMS, importance_sampling_level="sequence")
VESPO_TERMS = dataclasses.replace(TOKEN_TERMS, loss_type="vespo", off_policy_mask_threshold=0.05, entropy_coef=0.05)
CASES = {"grpo": (TOKEN_TERMS, "grpo"), "dr_grpo": (TOKEN_TERMS, "dr_grpo"), "gspo": (SEQUENCE_TERMS, "grpo"),
         "vespo": (VESPO_TERMS, "vespo")}


def _value_and_grad(graphdef, terms, params, batch, par):
  def loss_fn(params):
    loss, aux = models.loss(graphdef, params, batch, par, denominator=jnp.float32(1), aux=True,
                            objective=functools.partial(grpo_objective.weighted, terms), temperature=TEMPERATURE)
    return loss, aux.stats
  return jax.value_and_grad(loss_fn, has_aux=True)(params)


@pytest.fixture(scope="module")
def one_device_update():
  """A 4-layer model, one rollout's update inputs and their loss, statistics and gradient on
  one device for each of CASES. The rollout: 8 prompts of 1 to 8 tokens and completions of
  1 to 6, packed into rows of 24 (16 + 6, a multiple of cp's 4 chunks; 8 rows: the meshes'
  data-parallel ranks times micro-batches), old and reference log-probs off the policy's by noise (ratios clipped
  both ways), advantages. One device's loss is checked against policy_loss's on its
  log-probs and entropies (TRL-checked in tests/test_train_grpo_objective.py)."""
  cfg = models.preset("tiny", num_layers=4, d_model=32, num_heads=2, seq_len=SEQ_LEN)
  graphdef, params = models.init(cfg, seed=0)
  rng = np.random.default_rng(4)  # ratios clipped both ways; OPSM drops 2 of the 5 completions of A < 0
  B, M = 8, 6
  prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in rng.integers(1, 9, B)]
  lengths_B = rng.integers(1, M + 1, B)
  layout = grpo_batch.packed(prompts, rng.integers(0, cfg.vocab_size, (B, M)).astype(np.int32), lengths_B, SEQ_LEN,
                             unit=8, multiple=4)
  logps = jax.jit(grpo_batch.token_logps, static_argnums=(0, 3, 4, 5))
  logps_BxM, entropies_BxM = logps(graphdef, params, layout, TEMPERATURE, models.Parallelism(), True)
  old_BxM, ref_BxM = (logps_BxM + jnp.asarray(rng.normal(0, 0.3, (B, M)), jnp.float32) for _ in range(2))
  mask_BxM = jnp.asarray(np.arange(M)[None] < lengths_B[:, None], jnp.float32)
  advantages_B = jnp.asarray(rng.normal(size=B), jnp.float32)
  inputs = (old_BxM, ref_BxM, advantages_B, mask_BxM)
  step = jax.jit(functools.partial(_value_and_grad, graphdef, par=models.Parallelism()), static_argnums=0)
  results = {}
  for case, (terms, loss_type) in CASES.items():
    objective = dataclasses.replace(terms, loss_type=loss_type, max_completion_length=M)
    fields = grpo_objective.per_token_fields(*inputs, objective, mask_BxM.sum(), entropy_coef=objective.entropy_coef)
    (loss, stats), grads = step(terms, params, grpo_batch.update_batch(layout, fields))
    expected, expected_stats = grpo_objective.policy_loss(logps_BxM, old_BxM, advantages_B, mask_BxM, objective,
                                                          ref_BxM, entropies_BxM=entropies_BxM,
                                                          entropy_coef=objective.entropy_coef)
    np.testing.assert_allclose(loss, expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats), np.asarray(expected_stats), atol=1e-6)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert float(stats.kl) > 0
    if terms.importance_sampling_level == "token" and loss_type != "vespo":  # a sequence's mean ratio stays inside the clip here
      assert float(stats.clip_low) > 0 and float(stats.clip_high) > 0
    results[case] = (terms, fields, loss, stats, grads)
  return cfg, graphdef, params, layout, logps_BxM, results


def test_pipelined_and_context_parallel_loss_and_gradient_are_one_devices(one_device_update):
  """GRPO's objective on packed rows through models.loss's pp and cp forward (shard_map,
  custom_vjp), both in one program on fs=2,pp=2,cp=2 with 4 micro-batches (a mesh for each
  compiled every objective twice): the log-probs, loss, statistics and gradient equal one
  device's, for the
  grpo and dr_grpo aggregations, GSPO's sequence-level ratio, VESPO with OPSM (their sums
  over each completion's tokens taken over cp) and the entropy bonus, with beta > 0.
  Achieved (CPU, float32): log-probs within 1.9e-6, loss within 9e-8, statistics within
  3e-8 (the entropy, 4.5, and φ within 7e-7 relative), gradients within 1.7e-6 of their
  largest entry; checked at about 3-10x those."""
  cfg, graphdef, params_one, layout, logps_one, results = one_device_update
  mesh = setup.make_mesh("fs=2,pp=2,cp=2")
  par = models.Parallelism(mesh, microbatches=4)
  _, shapes = models.abstract(cfg, par)
  params_mesh = jax.device_put(dict(params_one, blocks=models.to_stages(models.to_layers(params_one["blocks"], 1),
                                                                       par.pp)),
                               jax.tree.map(lambda s: s.sharding, shapes))
  step = jax.jit(functools.partial(_value_and_grad, graphdef, par=par), static_argnums=0)
  with jax.set_mesh(mesh):
    logps_mesh = jax.jit(functools.partial(grpo_batch.token_logps, par=par), static_argnums=(0, 3))(
        graphdef, params_mesh, layout, TEMPERATURE)
    np.testing.assert_allclose(logps_mesh, logps_one, atol=1e-5)
    for terms, fields, loss_one, stats_one, grads_one in results.values():
      (loss, stats), grads = step(terms, params_mesh, grpo_batch.update_batch(layout, fields))
      np.testing.assert_allclose(loss, loss_one, atol=1e-6)
      np.testing.assert_allclose(np.asarray(stats), np.asarray(stats_one), atol=3e-7, rtol=2e-6)
      grads = dict(grads, blocks=models.to_layers(grads["blocks"], par.pp))
      grads_one = dict(grads_one, blocks=models.to_layers(grads_one["blocks"], 1))
      scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads_one))
      for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_one)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("policy", ["selective", "minimal_offloaded"])
def test_the_update_under_a_recompute_policy_is_nones(one_device_update, policy):
  """GRPO's update (packed rows, segment ids, the entropy and the KL) under a recompute
  policy: the loss, statistics and gradient of ``none``'s program within float32 rounding
  (measured on this CPU: loss within 1.5e-8 of -0.0058, statistics equal, gradients within
  2.9e-7 of their largest entry; checked at about 5x those)."""
  cfg, _, params, layout, _, results = one_device_update
  graphdef, _ = models.init(dataclasses.replace(cfg, remat=policy))
  terms, fields, loss_none, stats_none, grads_none = results["grpo"]
  (loss, stats), grads = jax.jit(functools.partial(_value_and_grad, graphdef, par=models.Parallelism()),
                                 static_argnums=0)(terms, params, grpo_batch.update_batch(layout, fields))
  np.testing.assert_allclose(loss, loss_none, atol=1e-7)
  np.testing.assert_allclose(np.asarray(stats), np.asarray(stats_none), atol=1e-7)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads_none))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_none), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1.5e-6 * scale)


def test_remat_takes_a_policy_and_alone_means_full():
  assert grpo_config.parse(["--remat"])[1]["remat"] == "full"
  assert grpo_config.parse(["--remat", "save_qkv_proj"])[1]["remat"] == "save_qkv_proj"


def strict_records(run_dir) -> list[dict]:
  """metrics.jsonl's records, read as strict JSON (a bare NaN or Infinity fails the test)."""
  def refuse(constant):
    pytest.fail(f"{run_dir}/metrics.jsonl holds a bare {constant}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line, parse_constant=refuse) for line in f]


def small_run(base_run, prompts_file, run_dir, *extra) -> int:
  """A GRPO run of the resume test's shapes (one device, AdamW, 2 prompts x 4)."""
  return grpo.main(["--init-from", base_run, "--prompts", prompts_file, "--run-dir", str(run_dir),
                    "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--mesh", "fs=1",
                    "--optimizer", "adamw", "--lr-decay-style", "constant", "--lr-warmup-steps", "0",
                    "--reward", "tests.test_train_grpo:digits_reward", *extra])


def test_a_non_finite_update_is_skipped_counted_and_stops_the_run(compile_cache, base_run, prompts_file,  # noqa: F811
                                                                  tmp_path, capsys):
  """--lr 1e39 passes the flag checks (finite) but is inf in float32: every update would
  write inf into the policy, so the step's guard skips it (counted in the log) and the
  policy stays the starting one, bit for bit; --max-skipped updates in a row stop the run
  with exit 3 and one line, as in train.gpt."""
  kept = tmp_path / "kept"
  assert small_run(base_run, prompts_file, kept, "--lr", "1e39", "--steps", "2", "--max-skipped", "5") == 0
  assert [r["skipped"] for r in strict_records(kept)] == [1, 1]
  for got, start in zip(jax.tree.leaves(restore_lib.restore(str(kept)).params),
                        jax.tree.leaves(restore_lib.restore(base_run).params)):
    np.testing.assert_array_equal(got, start)
  capsys.readouterr()
  stopped = tmp_path / "stopped"
  assert small_run(base_run, prompts_file, stopped, "--lr", "1e39", "--steps", "4", "--max-skipped", "2",
                   "--updates-per-rollout", "1") == 3
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: stopped after 2 consecutive iterations with a non-finite loss, gradient or"
                            " update (--max-skipped 2); no checkpoint was written"), err
  assert [r["step"] for r in strict_records(stopped)] == [1, 2]


@pytest.fixture(scope="module")
def poisoned_run(base_run, tmp_path_factory):
  """base_run with a NaN in its final norm: every log-probability and loss is NaN."""
  run_dir = str(tmp_path_factory.mktemp("grpo") / "poisoned")
  restored = restore_lib.restore(base_run)
  params = dict(restored.params, final_norm={"scale": restored.params["final_norm"]["scale"] * np.nan})
  with open(os.path.join(base_run, "config.json")) as f:
    record = json.load(f)
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(record, f)
  checkpoints = ckpt_lib.Checkpoints(os.path.join(run_dir, "checkpoints"), keep=1, create=True)
  checkpoints.save(1, {"params": params}, {"step": 1}, record)
  checkpoints.close()
  return run_dir


def test_metrics_hold_no_bare_nan(compile_cache, poisoned_run, prompts_file, tmp_path, capsys):  # noqa: F811
  """A policy that is NaN from the start: its loss is NaN, every update is skipped, the
  record says so with null (strict JSON), and the run exits 3 naming the cause."""
  run_dir = tmp_path / "run"
  assert small_run(poisoned_run, prompts_file, run_dir, "--steps", "1") == 3
  assert "are not finite at the end of the run, from the initialization" in capsys.readouterr().err
  (record,) = strict_records(run_dir)
  assert record["loss"] is None and record["grad_norm"] is None and record["skipped"] == 1


def _rp_bytes(run: setup.Run, batch: dict) -> int:
  """The bytes the run's compiled step moves over rp per device, counted per run of each loop."""
  with jax.set_mesh(run.mesh):
    compiled = run.train_step.lower(run.state, batch).compile()
  run.checkpoints.close()
  run.directory.close()
  return sum(s.bytes for s in dion_jax.collective_stats(compiled, run.mesh, trip_counts=True) if "rp" in s.axes)


# Dion over rp=2 in GRPO: the flags of both tests below, which thereby share the compiled step.
REPLICAS = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--reward",
            "tests.test_train_grpo:digits_reward", "--optimizer", "dion", "--dion-rank-fraction", "0.25",
            "--clip-grad", "0", "--beta", "0.04", "--updates-per-rollout", "3", "--lr", "1e-2", "--grad-norm", "exact"]


def test_rp2_dion_syncs_over_replicas_as_train_gpt(compile_cache, base_run, prompts_file, tmp_path):  # noqa: F811
  """GRPO's step on rp=2 with Dion is train.gpt's: per-replica gradients for Dion's
  matrices, whose low-rank factors are averaged over rp. Its bytes over rp equal train.gpt's
  for the same model and mesh, but for the objective's statistics (KL and clip shares,
  gathered with the loss); the momentum has one copy per replica. The step is
  test_rp2_dion_and_accumulation_equal_one_device's on rp=2 (the same flags: one compile for
  both). Measured (Dion at rank 1/4, where it compresses): 258,818 bytes against train.gpt's
  258,762."""
  grpo_cfg, cfg, _ = grpo.configure(["--init-from", base_run, "--prompts", prompts_file, "--run-dir",
                                     str(tmp_path / "grpo"), *REPLICAS, "--mesh", "rp=2"])
  run = grpo_loop.setup(grpo_cfg, cfg)
  momentum = [x for x in jax.tree.leaves(run.state.opt_state) if len(x.sharding.spec) and x.sharding.spec[0] == "rp"]
  assert momentum and all(x.shape[0] == 2 for x in momentum)
  grpo_bytes = _rp_bytes(run, run.data.first.batch)
  cfg = config_lib.Config(num_layers=2, hidden_size=32, num_attention_heads=2, seq_len=SEQ_LEN, mesh="rp=2",
                          optimizer="dion", dion_rank_fraction=0.25, clip_grad=0, grad_norm="exact",
                          global_batch_size=8, steps=1, eval_tokens=0, run_dir=str(tmp_path / "gpt"))
  reference = setup.setup(cfg)
  assert reference.model_cfg == run.model_cfg
  gpt_bytes = _rp_bytes(reference, loop.global_batch(reference, next(reference.data.loader)))
  print(f"bytes over rp: GRPO {grpo_bytes}, train.gpt {gpt_bytes}")
  assert 0 <= grpo_bytes - gpt_bytes <= 64, (grpo_bytes, gpt_bytes)


def test_rp2_dion_and_accumulation_equal_one_device(compile_cache, base_run, prompts_file, tmp_path):  # noqa: F811
  """Three updates on one rollout with Dion and the KL term, clipping off: on rp=2 (Dion's
  per-replica path, each replica half the rollout) and with the rollout's updates in two
  micro-batches (gradient accumulation) the metrics and the policy are one device's, the logged
  norm the replicas' mean gradient's (--grad-norm exact; rms logs their local norms'). (One
  rollout: the next one's samples would follow each run's last-bit differences.) Achieved:
  metrics within 6.6e-7 (the KL, 0.16, accumulated; the others within 1.7e-7), parameters
  within 6.6e-7 of their largest entry on rp=2 and 9.8e-7 accumulated (but AdamW's rows of
  rare tokens, below); checked at about 1.5x (the KL) to 5x."""
  common = ["--init-from", base_run, "--prompts", prompts_file, *REPLICAS]
  runs = {"one": ["--mesh", "fs=1"], "replicas": ["--mesh", "rp=2"],
          "accumulated": ["--mesh", "fs=1", "--micro-batch-size", "4"]}  # 2 micro-batches of 4
  for name, flags in runs.items():
    assert grpo.main([*common, *flags, "--run-dir", str(tmp_path / name)]) == 0
  records = {name: strict_records(tmp_path / name) for name in runs}
  timing = ("rollout_s", "train_s", "rollout_tokens_per_s", "train_tokens_per_s")
  for name in ("replicas", "accumulated"):
    for a, b in zip(records["one"], records[name]):
      assert {k: v for k, v in b.items() if k not in timing} == pytest.approx(
          {k: v for k, v in a.items() if k not in timing}, abs=1e-6), name
  assert records["one"][0]["kl"] > 0
  start, one, replicas, accumulated = (restore_lib.restore(str(d)).params
                                       for d in (base_run, *(tmp_path / name for name in runs)))
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(one))
  for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree.leaves(replicas),
                             jax.tree.leaves(accumulated)):
    name = jax.tree_util.keystr(path)
    np.testing.assert_allclose(b, a, atol=4e-6 * scale, err_msg=name)
    # AdamW's elementwise step turns the rounding of a summed near-zero gradient (the
    # embedding and LM head rows of tokens seen once or never) into a step of another size:
    # those rows differ by up to 1% of their step.
    if "embed" not in name and "lm_head" not in name:
      np.testing.assert_allclose(c, a, atol=4e-6 * scale, err_msg=name)
  assert any(not np.allclose(a, s) for a, s in zip(jax.tree.leaves(one), jax.tree.leaves(start)))


def letter_reward(prompts, completions, **_):
  """The share of a completion's characters that are "a": 1/257 for the untrained model,
  learned within 30 steps."""
  return [sum(ch == "a" for ch in c) / max(len(c), 1) for c in completions]


@pytest.mark.slow
def test_float16_with_loss_scaling_ends_where_float32_does(compile_cache, base_run, prompts_file, tmp_path):  # noqa: F811
  """30 steps of the same run in float32 and in float16 (dynamic loss scaling, its scale
  doubling every 5 clean steps): both learn the reward from ~0 to ~1 (the last 10 steps'
  mean 0.995 each), and their mean reward over the 30 steps differs by less than float32's
  own spread over seeds 0, 1, 2 on this machine (0.704, 0.773, 0.765); measured: float16
  0.695, float32 0.704. The float16 gradient the optimizer sees is unscaled (its norm as
  float32's)."""
  records = {}
  for dtype in ("float32", "float16"):
    run_dir = tmp_path / dtype
    assert grpo.main(["--init-from", base_run, "--prompts", prompts_file, "--run-dir", str(run_dir), "--steps", "30",
                      "--prompts-per-step", "3", "--group-size", "8", "--max-new-tokens", "8", "--mesh", "fs=1",
                      "--reward", "tests.test_train_grpo:letter_reward", "--optimizer", "adamw", "--lr", "1e-2",
                      "--lr-decay-style", "constant", "--lr-warmup-steps", "0", "--dtype", dtype,
                      "--loss-scale-window", "5"]) == 0
    records[dtype] = strict_records(run_dir)
  for got in records.values():
    rewards = [r["reward_mean"] for r in got]
    assert rewards[0] < 0.05 and np.mean(rewards[-10:]) > 0.95
  half, full = ([r["reward_mean"] for r in records[d]] for d in ("float16", "float32"))
  assert abs(np.mean(half) - np.mean(full)) < 0.04
  scales = [r["loss_scale"] for r in records["float16"]]
  assert scales[0] == 2.0**16 and max(scales) > scales[0]
  norms = {d: np.median([r["grad_norm"] for r in records[d][:10]]) for d in records}
  assert norms["float16"] == pytest.approx(norms["float32"], rel=0.5)


@pytest.mark.slow
def test_gsm8k_shaped_parquet_end_to_end(compile_cache, tmp_path):  # noqa: F811
  """A GSM8K-shaped Parquet file (question, answer = reasoning then "#### N"): train.gpt
  fine-tunes a byte-level GPT on its answers, then train.grpo trains it on the same file
  with the shipped example config (docs/examples/grpo_gsm8k.yaml: --prompt-column question,
  the built-in answer reward, which compares the number after ####), its paths, sizes and
  mesh those of this test on one process. The run ends with a finite policy and per-step
  answer rewards in [0, 1]."""
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  from data import prompts as prompts_lib
  from train import gpt

  rng = np.random.default_rng(0)
  rows = []
  for a, b in rng.integers(1, 50, (64, 2)):
    rows.append({"question": f"{a}+{b}=", "answer": f"{a}+{b}={a + b}.\n#### {a + b}"})
  parquet = tmp_path / "train-00000-of-00001.parquet"
  pq.write_table(pa.Table.from_pylist(rows), str(parquet))
  sft = tmp_path / "sft.jsonl"
  sft.write_text("".join(json.dumps({"prompt": r["question"], "completion": r["answer"]}) + "\n"
                         for r in prompts_lib.read_rows(str(parquet))))
  model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-len", str(SEQ_LEN)]
  assert gpt.main(["--data", f"sft:{sft}", *model, "--optimizer", "adamw", "--steps", "20", "--global-batch-size", "8",
                   "--mesh", "fs=1", "--eval-every", "0", "--eval-tokens", "0", "--run-dir", str(tmp_path / "sft")]) == 0
  run_dir = tmp_path / "grpo"
  with open(EXAMPLE) as f:
    example = yaml.safe_load(f)
  for multi_host in ("coordinator", "num_processes"):
    del example[multi_host]
  config = tmp_path / "gsm8k.yaml"
  config.write_text(yaml.safe_dump({**example, "init_from": str(tmp_path / "sft"), "prompts": str(parquet),
                                    "run_dir": str(run_dir), "mesh": "fs=1", "prompts_per_step": 2, "group_size": 4,
                                    "max_new_tokens": 12, "lr": 1e-3, "lr_warmup_steps": 0}))
  assert grpo.main(["--config", str(config), "--steps", "2"]) == 0
  for record in strict_records(run_dir):
    assert 0 <= record["reward/answer/mean"] <= 1 and record["skipped"] == 0
  assert restore_lib.restore(str(run_dir)).step == 2


# The multi-process runs: KL on, two rewards, a constant lr (runs of other --steps compare step by step).
PROCESSES = ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--beta", "0.04", "--lr", "1e-2",
             "--lr-decay-style", "constant", "--lr-warmup-steps", "0", "--reward", "tests.test_train_grpo:digits_reward",
             "--reward", "format=0.5", "--save-every", "2"]
TIMING = ("rollout_s", "train_s", "rollout_tokens_per_s", "train_tokens_per_s")


def two_processes(cache: str, run_dir, *args: str) -> list[subprocess.Popen]:
  """Processes 0 and 1 of a GRPO run on 127.0.0.1, 2 CPU devices each (gloo), each in a
  process group of its own as on two hosts."""
  port = free_port()
  return [subprocess.Popen([sys.executable, "-m", "train.grpo", *args, "--run-dir", str(run_dir), "--coordinator",
                            f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                           env=subprocess_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), start_new_session=True)
          for i in range(2)]


def assert_same_steps(run_dir, reference, steps: list[int]) -> None:
  """The run's metrics at ``steps`` (a resumed run's later records win) are ``reference``'s
  within 1e-6, but for the timings."""
  got = {r["step"]: r for r in strict_records(run_dir)}
  want = {r["step"]: r for r in strict_records(reference)}
  assert sorted(got) == steps
  for step in steps:
    assert {k: v for k, v in got[step].items() if k not in TIMING} == pytest.approx(
        {k: v for k, v in want[step].items() if k not in TIMING}, abs=1e-6), step


@pytest.mark.slow
def test_two_processes_match_one_with_dion_over_replicas_and_resume_after_process_0_dies(  # noqa: F811
    compile_cache, base_run, prompts_file, tmp_path):
  """Two processes x 2 devices on rp=2,fs=2 (a replica per process: the batch split across
  them, Dion's momentum one copy per process) take the prompts, completions, rewards and
  updates of one process with the 4 devices: each process scores the completions it sampled,
  and the rewards of every group reach both; only process 0 logs and writes. Process 0 is
  killed with its process group once step 3 is logged: process 1 ends with one line naming
  process 0 and the last checkpoint (``train/run/agent.py``), exit 1, nothing partial left,
  the lock released; --resume on one process with the 4 devices then continues from the two
  processes' checkpoint: every step's metrics, and the final policy, are those of one process
  that never stopped (measured: metrics and policy equal to the last bit)."""
  args = ["--init-from", base_run, "--prompts", prompts_file, *PROCESSES, "--optimizer", "dion",
          "--dion-rank-fraction", "0.25", "--mesh", "rp=2,fs=2"]
  run_dir = tmp_path / "two"
  procs = two_processes(compile_cache, run_dir, *args, "--steps", "1000")
  try:
    wait_for_step(run_dir, 3, procs)
    os.killpg(procs[0].pid, signal.SIGKILL)
    out, err = procs[1].communicate(timeout=120)
  finally:
    for p in procs:
      p.kill()
    first_out = procs[0].communicate()[0]
    procs[1].communicate()
  assert "(2 processes)" in first_out and "step" not in out
  steps = sorted(int(n) for n in os.listdir(run_dir / "checkpoints"))  # none partial
  assert procs[1].returncode == 1, err[-3000:]
  assert re.fullmatch(r"error: process 0 of 2 \(the coordinator\) stopped: its coordination service at 127.0.0.1:\d+"
                      r" does not answer \(Connection refused\), and JAX ended this process; the last whole checkpoint"
                      rf" is step {steps[-1]} in {run_dir / 'checkpoints'}; continue with: python -m train.grpo --run-dir"
                      rf" {run_dir} --resume --coordinator 127.0.0.1:\d+ --num-processes 2 --process-id 1\n", err), err
  assert not (run_dir / "run.lock").exists()
  assert grpo.main(["--run-dir", str(run_dir), "--resume", "--steps", str(steps[-1] + 1)]) == 0
  assert grpo.main([*args, "--run-dir", str(tmp_path / "one"), "--steps", str(steps[-1] + 1)]) == 0
  assert_same_steps(run_dir, tmp_path / "one", list(range(1, steps[-1] + 2)))
  for a, b in zip(jax.tree.leaves(restore_lib.restore(str(run_dir)).params),
                  jax.tree.leaves(restore_lib.restore(str(tmp_path / "one")).params)):
    np.testing.assert_allclose(a, b, atol=1e-6)


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "examples",
                       "grpo_gsm8k.yaml")


def test_the_gsm8k_example_config_parses_and_prints_back(tmp_path, capsys):
  """The shipped example is a valid run on two processes (process 1 here): its flags pass the
  checks, and --print-config writes a file that reads back as the same flags."""
  grpo_cfg, cfg, printed = grpo.configure(["--config", EXAMPLE, "--process-id", "1", "--print-config"])
  assert printed and (cfg.num_processes, cfg.process_id, cfg.mesh) == (2, 1, "rp=2,fs=8")
  assert (grpo_cfg.prompt_column, grpo_cfg.reward, grpo_cfg.rollout_size) == ("question", ("answer", "format=0.2"), 512)
  again = tmp_path / "printed.yaml"
  again.write_text(capsys.readouterr().out)
  assert grpo.configure(["--config", str(again)]) == (grpo_cfg, cfg, False)


def test_a_config_file_run_is_the_flags_run(compile_cache, base_run, prompts_file, tmp_path, capsys):  # noqa: F811
  """The flags of a run printed with --print-config, then run from that file (another
  --run-dir on the command line): the same metrics and policy, bit for bit."""
  flags = ["--init-from", base_run, "--prompts", prompts_file, "--prompts-per-step", "2", "--group-size", "4",
           "--max-new-tokens", "6", "--mesh", "fs=1", "--optimizer", "adamw", "--lr", "1e-2", "--beta", "0.04",
           "--reward", "tests.test_train_grpo:digits_reward", "--reward", "format=0.5", "--steps", "2"]
  assert grpo.main([*flags, "--run-dir", str(tmp_path / "flags"), "--print-config"]) == 0
  config = tmp_path / "run.yaml"
  config.write_text(capsys.readouterr().out)
  assert not os.path.exists(tmp_path / "flags")  # printing runs nothing
  assert grpo.main([*flags, "--run-dir", str(tmp_path / "flags")]) == 0
  assert grpo.main(["--config", str(config), "--run-dir", str(tmp_path / "file")]) == 0
  records = [[{k: v for k, v in r.items() if k not in TIMING} for r in strict_records(tmp_path / d)]
             for d in ("flags", "file")]
  assert records[0] == records[1] and len(records[0]) == 2
  for a, b in zip(*(jax.tree.leaves(restore_lib.restore(str(tmp_path / d)).params) for d in ("flags", "file"))):
    np.testing.assert_array_equal(a, b)


def test_help_shows_every_default(capsys):
  """--help names a default (or says the flag is needed) for every flag that takes a
  value; the flags shared with train.gpt show train.gpt's help text."""
  from train.run import flags
  parser = grpo_config.parser()
  for action in parser._actions:
    if action.option_strings and action.nargs != 0 and action.dest != "help":
      assert "default" in action.help or "(needed" in action.help, action.dest
    if action.dest in grpo_config.SHARED:
      assert action.help == flags.HELP[action.dest]
  with pytest.raises(SystemExit):
    grpo.main(["--help"])
  assert "--dion-rank-fraction" in capsys.readouterr().out
  # --resume's help names the flags a resumed run may change, and only those (the multi-host ones together)
  named = set(re.findall(r"--([a-z-]+)", flags.GRPO_HELP["resume"])) - {"step", "run-dir"}
  assert named == {name.replace("_", "-") for name in grpo_config.MAY_CHANGE if name not in (
      "resume", "run_dir", "step", *grpo_config.MULTI_HOST)}


def test_a_new_run_takes_the_starting_runs_model_not_its_optimizer(tmp_path):
  """The run's Config: the starting run's model fields, train.gpt's defaults for the shared
  flags left off (not the starting run's), the rollout as the global batch, the schedule
  over --steps x --updates-per-rollout optimizer updates."""
  start = {"num_layers": 3, "hidden_size": 48, "optimizer": "adamw", "lr": 0.5, "weight_decay": 0.3}
  argv = ["--init-from", str(tmp_path), "--prompts", "p.jsonl", "--reward", "format", "--run-dir", str(tmp_path / "r"),
          "--steps", "10", "--updates-per-rollout", "3", "--prompts-per-step", "4", "--group-size", "2"]
  grpo_cfg, shared = grpo_config.parse([*argv, "--lr", "0.01"])
  trl_named = [{"--updates-per-rollout": "--num-iterations"}.get(a, a) for a in argv]  # TRL's name, an alias
  assert grpo_config.parse([*trl_named, "--lr", "0.01"])[0] == grpo_cfg
  cfg = grpo_config.train_config(grpo_cfg, shared, start)
  assert (cfg.num_layers, cfg.hidden_size) == (3, 48)
  assert (cfg.optimizer, cfg.lr, cfg.weight_decay) == ("dion", 0.01, config_lib.Config().weight_decay)
  assert (cfg.global_batch_size, cfg.decay_steps, cfg.warmup_steps) == (8, 30, 1)
