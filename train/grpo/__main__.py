"""GRPO fine-tuning of a trained GPT with verifiable rewards:
``python -m train.grpo --init-from RUN_DIR --prompts FILE --reward answer --reward format=0.2 --run-dir DIR``.

Each step takes ``--prompts-per-step`` rows of the prompts (in a seeded order, epoch
after epoch), samples ``--group-size`` G completions of each with ``models.generate``'s
key/value cache from the current policy (on-policy; the rollout's rows split over the
mesh's batch axes and the model over tp, as the training step's), scores them with the
reward functions (``train/grpo/rewards.py``), turns the rewards into advantages and takes
``--updates-per-rollout`` (TRL's ``--num-iterations``) optimizer steps on the rollout with
TRL 1.16's objective (``train/grpo/objective.py``: the ``--loss-type``, importance sampling
level, two-sided clip, off-policy sequence mask, high-entropy mask, KL to the frozen
starting policy with ``--beta`` > 0 and entropy bonus), its completions packed with their
prompts several to a row (``train/grpo/batch.py``; ``--no-pack``: one to a row).

What is GRPO's own is in this package (``train/grpo/loop.py``, ``rollout.py``): the prompts, the rollouts,
the rewards and advantages, the update's rows. The rest is ``python -m train.gpt``'s (``train/run/setup.py``,
``train/run/loop.py``): the same set-up steps, the same jitted step (``train/run/step.py``, with GRPO's per-token objective in ``models.loss``: the
non-finite guard, float16 loss scaling, clipping, accumulation over
``--micro-batch-size``, Dion's per-replica path on rp, QK-clip, the schedules and
weight-decay groups), the same optimizer flags (``train/grpo/config.py``), the same run
directory (``train/store/rundir.py``: lock, config.json, metrics.jsonl, checkpoints, resume) and
exit codes: a step whose update is not finite changes nothing and is counted,
``--max-skipped`` in a row stop the run with exit 3.

Prompts (``data/prompts.py``): JSONL, Parquet, or a dataset saved by ``datasets``; each
row's ``--prompt-column`` text (tokenized as ``train.sample`` does) or chat
``"messages"`` (rendered by the tokenizer's chat template with the generation prompt),
and any columns the rewards read.

The run directory holds ``config.json`` (the run's Config as train.gpt's, so
``train.sample`` and ``train.export`` read the result as a run; GRPO's flags under
"grpo"), ``metrics.jsonl`` (one record a step: reward mean/std overall and per function,
advantage std, loss, KL, clip shares, learning rate, gradient norm, skipped updates,
completion lengths, the share cut at ``--max-new-tokens``, the sampler's log-probabilities
against the rollout policy's, rollout and update tokens/s)
and checkpoints of the trainer's state. ``--resume`` continues from the latest checkpoint
with the saved flags and the same rollouts as a run that never stopped: the prompts'
order and the sampler's seed follow from ``--seed`` and the step, the reference is the
starting run's checkpoint it began from.

``--config run.yaml`` reads the flags from a file (one file for the model's source, prompts,
rewards, objective, optimizer, mesh and processes; the command line wins) and
``--print-config`` prints them as one (``train/grpo/config.py``).

Several processes (``--coordinator HOST:PORT --num-processes N --process-id I`` on each, or
``--distributed``; ``docs/multihost.md``) split each rollout as they split the update batch:
each samples the rows its devices hold, decodes and scores its own completions (a reward
function sees that process's strings only), and the rewards, numbers, are gathered, so that
the advantages are taken over whole groups wherever their completions were sampled
(``train/grpo/rollout.py``). Process 0 writes ``metrics.jsonl``, the log and the checkpoint's
metadata; a lost or failed process ends them all with one line (``train/run/peers.py``,
``train/run/agent.py``).

Bad input prints one ``error: ...`` line and exits with code 2 before anything is
written: a missing run, prompts file, column or reward module, an empty prompts file,
G < 2, a prompt that leaves less than ``--max-new-tokens`` of the model's ``seq_len``, a
reward that raises or is not finite (the first rollout is scored during set-up), a
rollout that does not split over the mesh, a flag ``--resume`` may not change, a run
directory in use.
"""

import numpy  # noqa: F401  numpy's own OpenBLAS loads first, keeping its threads

from train import cli
from train.grpo import config as grpo_config
from train.grpo.config import GRPOConfig
from train.run import agent, config_file, start
from train.run import config as config_lib


def configure(argv: list[str] | None) -> tuple[GRPOConfig, config_lib.Config, bool]:
  """GRPO's flags, the run's Config (``train/grpo/config.py``), both checked, and whether
  ``--print-config`` was given."""
  grpo, shared, print_config = grpo_config.command(argv)
  grpo.check()
  start_run = config_lib.saved_config(grpo.run_dir if grpo.resume else grpo.init_from)
  cfg = grpo_config.train_config(grpo, shared, start_run)
  if print_config:
    from train.run import model_source  # imports jax, models: this process starts no run

    record = grpo_config.flags_record(grpo, shared)
    record["lr"] = cfg.learning_rate  # the optimizer's default, written out
    notes = {**model_source.RESOLVED_AT_START, "lr_decay_steps": "--steps x --updates-per-rollout",
             "dion_rank_fraction": "by the starting model's width"}
    print(config_file.to_yaml(record, notes), end="")
  return grpo, cfg, print_config


def _setup(argv: list[str] | None):
  """The run of ``argv``, or the exit code of what ran instead (``--print-config``; the agent
  of a multi-host run's process, ``train/run/agent.py``); bad input raises here, before
  anything is written."""
  grpo, cfg, print_config = configure(argv)
  if print_config:
    return 0
  grpo.check_inputs()
  if agent.wanted(cfg):  # this process watches a worker that runs the command
    return agent.supervise(cfg, "train.grpo", agent.worker_command("train.grpo", argv))
  start.start_jax(cfg)  # host devices for the mesh and the multi-host runtime, before JAX starts
  from train.grpo import loop  # import jax, models, dion_jax, data
  from train.run import peers

  peers.watch(cfg, "train.grpo")  # several processes: a fault in one, or a lost one, ends them all
  with peers.together(setting_up=True):
    return loop.setup(grpo, cfg)


def _train(run) -> int:
  if isinstance(run, int):
    return run
  from train.grpo import loop

  return agent.ended(loop.train(run))  # under an agent, it learns the code before JAX's shutdown


def main(argv: list[str] | None = None) -> int:
  # The set-up writes nothing until its end: a Ctrl-C there leaves nothing behind.
  return cli.run(lambda: _setup(argv), _train, interrupted="interrupted before training started; nothing was saved")


if __name__ == "__main__":
  cli.exit(main())
