"""A model's parameters saved as a ``python -m train.gpt`` run (config.json and an Orbax
checkpoint at step 1), untrained: the ``--init-from`` of tests that start from a run."""
import dataclasses
import json
import os

import models
from train.run import config as config_lib
from train.store import checkpoint as ckpt_lib


def save(run_dir: str, cfg: models.GPTConfig, params: dict, train_cfg: config_lib.Config) -> str:
  """``params`` (layers stacked, as ``models.init`` gives them) saved as ``train_cfg``'s run of ``cfg``."""
  record = {"train": dataclasses.replace(train_cfg, run_dir=run_dir).to_json(), "model": dataclasses.asdict(cfg)}
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(record, f)
  checkpoints = ckpt_lib.Checkpoints(os.path.join(run_dir, "checkpoints"), keep=1, create=True)
  checkpoints.save(1, {"params": dict(params, blocks=models.to_layers(params["blocks"], 1))}, {"step": 1}, record)
  checkpoints.close()
  return run_dir
