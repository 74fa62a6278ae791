"""Run configuration files: ``python -m train.gpt --config run.yaml`` and ``--print-config``
(and ``python -m train.grpo``'s, with its own flags).

A file (YAML, or JSON by its ``.json`` extension) maps flags to values, each key a flag
without its dashes, ``lr_warmup_steps`` or ``lr-warmup-steps``::

    preset: small
    optimizer: dion
    lr: 0.02
    mesh: rp=1,fs=4,tp=2
    data: [0.7, "fineweb:data/*.bin", 0.3, stdlib]
    remat: selective
    tensorboard: ""      # the flag without a value: RUN_DIR/tensorboard

Flags on the command line override the file. A value goes through the parser of its
flag (``train.run.config``'s), so a bad one is refused as on the command line, with one
line naming the file and the key; so is a key that names no flag. ``null`` stands for
the default of flags whose default is "none given" (``mesh``, ``lr``, ...). A run's own
``config.json`` is a config file too: its ``train`` record (and a GRPO run's ``grpo``), less
what describes one invocation (``run_dir``, ``resume``, ``step``, the multi-host flags) and
what is no flag of the command (a GRPO run's model, taken from the run it started from), so
``--config runs/a/config.json --run-dir runs/b`` repeats run a in runs/b.
``--print-config`` writes the resolved flags in this format: reading them back gives
the same configuration.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Iterable

import yaml

from train.cli import UsageError
from train.run.flags import FORMER_VALUES


def read(path: str) -> tuple[dict, bool]:
  """The file's mapping of keys to values, and whether it is a run's config.json (then
  the mapping is its ``train`` record, with a GRPO run's ``grpo`` record)."""
  try:
    with open(path) as f:
      record = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
  except FileNotFoundError:
    raise UsageError(f"--config {path} does not exist; pass a YAML or JSON file of flags") from None
  except (OSError, ValueError, yaml.YAMLError) as e:
    detail = " ".join(str(e).split())
    raise UsageError(f"--config {path} is not readable {'JSON' if path.endswith('.json') else 'YAML'}: {detail}") from None
  if isinstance(record, dict) and isinstance(record.get("train"), dict) and "model" in record:
    return {**record["train"], **record.get("grpo", {})}, True
  if not isinstance(record, dict):
    raise UsageError(f"--config {path}: expected a mapping of flags to values (key: value lines)")
  return record, False


def given(path: str, parser: argparse.ArgumentParser, fields: Iterable[dataclasses.Field],
          skip: tuple[str, ...] = ()) -> dict:
  """The values of ``path``'s keys as ``parser`` reads the same flags from a command line
  (``{field: value}``; ``fields`` the dataclass fields of its flags). ``skip``: keys dropped
  from a run's config.json."""
  record, run_record = read(path)
  fields = {f.name: f for f in fields}
  values = {}
  for raw_key, value in record.items():
    key = str(raw_key).replace("-", "_")
    if run_record and (key in skip or key not in fields):
      continue
    if key not in fields:
      raise UsageError(f"--config {path}: unknown key {raw_key!r}; the keys are {parser.prog}'s flags"
                       " without their dashes (see --help)")
    values[key] = _value(path, key, value, fields[key], parser)
  return values


def _value(path: str, key: str, value, field: dataclasses.Field, parser: argparse.ArgumentParser):
  flag = "--" + key.replace("_", "-")
  where = f"--config {path}: {key}"
  if value is None:
    if field.default is not None:
      raise UsageError(f"{where}: null is no value of {flag}; leave the key out for its default")
    return None
  if field.type.startswith("bool"):
    if not isinstance(value, bool):
      raise UsageError(f"{where}: expected true or false, got {value!r}")
    return value
  several = field.type.startswith("tuple")
  if isinstance(value, bool) and value in FORMER_VALUES.get(key, {}):
    value = FORMER_VALUES[key][value]
  if isinstance(value, bool) or isinstance(value, dict) or (isinstance(value, list) and not several):
    raise UsageError(f"{where}: expected one value of {flag}, got {value!r}")
  words = [str(v) for v in value] if isinstance(value, list) else [str(value)]
  try:
    parsed = vars(parser.parse_args([flag, *words]))
  except UsageError as e:
    raise UsageError(f"{where}: {re.sub(r'^argument [^:]*: ', '', str(e))}") from None
  return tuple(parsed[key]) if several else parsed[key]


def to_yaml(values: dict) -> str:
  """``values`` (a Config's fields) as a config file."""
  plain = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
  return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)
