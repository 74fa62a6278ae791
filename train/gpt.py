"""Train a GPT: ``python -m train.gpt [--mesh rp=1,fs=2,tp=2] [--preset tiny] ...``.

With no arguments it trains the ``tiny`` preset with Dion on the embedded corpus on
every device there is, and writes ``config.json``, ``metrics.jsonl`` and checkpoints
under ``runs/tiny-dion/``. ``--help`` lists the flags (``train/run/flags.py``); ``--config
run.yaml`` reads them from a file and ``--print-config`` prints them as one
(``train/run/config_file.py``).

One step, top to bottom: this loop feeds a global batch to ``train/run/step.py``, whose
jitted step takes the model's loss and gradients (``models/gpt.py``, per rp replica
through ``dion_jax.parallel.synced_over_replicas``, averaged over rp once per step), clips, and
applies Dion (``dion_jax/optimizers/dion.py`` on ``optimizers/skeleton.py``;
``dion_jax/parallel/``: the collectives).

Bad input (flags, mesh, batch, data, checkpoints, an unusable or busy run directory)
ends the run before anything is written, with one ``error: ...`` line on stderr. Exit
codes: 0 done; 1 a checkpoint failed to save (the previous one intact), out of memory, or
a process of a multi-host run lost (``train/run/peers.py``, ``train/run/agent.py``); 2 bad input; 3 diverged
(non-finite or spiking steps); 130 / 143 stopped by SIGINT / SIGTERM after saving.
"""
from __future__ import annotations


import numpy  # noqa: F401  numpy's own OpenBLAS loads first, keeping its threads

from train import cli
from train.run import agent, config_file, start
from train.run import config as config_lib


def _setup(argv: list[str] | None):
  """The run of ``argv``, or the exit code of what ran instead (``--print-config``, which prints
  the resolved flags; the agent of a multi-host run's process, ``train/run/agent.py``); bad
  input raises here, before anything is written."""
  cfg, print_config = config_lib.command(argv)
  cfg.check()
  if print_config:
    from train.run import model_source  # imports jax, models: this process starts no run

    print(config_file.to_yaml(model_source.resolved_flags(cfg).to_json(), model_source.RESOLVED_AT_START), end="")
    return 0
  if agent.wanted(cfg):  # this process watches a worker that runs the command
    return agent.supervise(cfg, "train.gpt", agent.worker_command("train.gpt", argv))
  start.start_jax(cfg)
  from train.run import peers, setup  # import jax, models, dion_jax, data

  peers.watch(cfg)  # several processes: a fault in one, or a lost one, ends them all
  with peers.together(setting_up=True):
    return setup.setup(cfg)


def _train(run) -> int:
  if isinstance(run, int):
    return run
  from train.run import loop

  return agent.ended(loop.train(run))  # under an agent, it learns the code before JAX's shutdown


def main(argv: list[str] | None = None) -> int:
  # The set-up writes nothing until its end: a Ctrl-C there leaves nothing behind.
  return cli.run(lambda: _setup(argv), _train, interrupted="interrupted before training started; nothing was saved")


if __name__ == "__main__":
  cli.exit(main())
