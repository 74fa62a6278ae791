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

What is GRPO's own is in this package (``train/grpo/loop.py``): the prompts, the rollouts,
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
completion lengths, the share cut at ``--max-new-tokens``, rollout and update tokens/s)
and checkpoints of the trainer's state. ``--resume`` continues from the latest checkpoint
with the saved flags and the same rollouts as a run that never stopped: the prompts'
order and the sampler's seed follow from ``--seed`` and the step, the reference is the
starting run's checkpoint it began from.

Bad input prints one ``error: ...`` line and exits with code 2 before anything is
written: a missing run, prompts file, column or reward module, an empty prompts file,
G < 2, a prompt that leaves less than ``--max-new-tokens`` of the model's ``seq_len``, a
reward that raises or is not finite (the first rollout is scored during set-up), a
rollout that does not split over the mesh, a flag ``--resume`` may not change, a run
directory in use.
"""
import sys

from train import cli
from train.grpo import loop


def main(argv: list[str] | None = None) -> int:
  return cli.run(lambda: loop.setup(argv), loop.train)


if __name__ == "__main__":
  sys.exit(main())
