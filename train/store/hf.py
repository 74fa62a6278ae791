"""Hugging Face checkpoint directories: read onto a mesh, written atomically.

A directory holds ``config.json`` and the weights as ``model.safetensors`` or as shards
named by ``model.safetensors.index.json`` (its ``weight_map``: tensor -> file), plus the
tokenizer's files. Reading goes through the ``safetensors`` library, leaf by leaf with
``jax.make_array_from_callback``: each process reads, with ``safe_open(...).get_slice``,
only the slices its own devices hold, so no host ever holds the whole model. The mapping
of names and layouts is ``models/hf.py``'s. Nothing here imports torch.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

import models
from data import hf_tokenizer
from models import hf as hf_map
from train.cli import UsageError
from train.store import hub

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = hub.TOKENIZER_FILES
# A run's copy of its --init-from checkpoint's tokenizer files (and config.json, where the
# eos id may live): later commands read them from the run, not from a folder that may move.
RUN_TOKENIZER = "tokenizer"
# Above this many bytes of weights an export is split into shards (transformers' default
# max_shard_size is 5 GB; smaller shards load with less peak memory).
MAX_SHARD_BYTES = 2 * 2**30


def read_config(directory: str) -> dict:
  """The checkpoint's config.json; a missing directory or file is a UsageError."""
  path = os.path.join(directory, CONFIG)
  if not os.path.isdir(directory):
    raise UsageError(f"{directory} does not exist; hf:DIR is a local folder of config.json and"
                     " safetensors, or hf:ORG/NAME[@REVISION] a Hugging Face Hub id")
  if not os.path.isfile(path):
    raise UsageError(f"{directory}: no {CONFIG}; pass a Hugging Face checkpoint directory"
                     " (config.json + safetensors)")
  with open(path) as f:
    return json.load(f)


def model_config(directory: str, config: dict | None = None, **kwargs) -> models.GPTConfig:
  """:func:`models.hf.from_hf_config` of the directory's config (``config``, when already
  read), errors as UsageError."""
  try:
    return hf_map.from_hf_config(config or read_config(directory), **kwargs)
  except (hf_map.UnsupportedCheckpoint, KeyError) as e:
    raise UsageError(f"{directory}: {e if not isinstance(e, KeyError) else f'config.json lacks {e}'}") from None


def _open_weights(path: str):
  """``safe_open(path)``; a damaged file (a truncated download) is a UsageError."""
  try:
    return safe_open(path, "np")
  except SafetensorError as e:
    raise UsageError(f"{path} is not a complete safetensors file ({e}); download it again") from None


def _weight_files(directory: str) -> dict[str, str]:
  """Tensor name -> the safetensors file that holds it."""
  index = os.path.join(directory, INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      return {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
  single = os.path.join(directory, SINGLE)
  if not os.path.isfile(single):
    raise UsageError(f"{directory}: neither {SINGLE} nor {INDEX}; only safetensors weights are read")
  with _open_weights(single) as f:
    return dict.fromkeys(f.keys(), single)


class _Reader:
  """Slices of the directory's tensors, files opened once."""

  def __init__(self, directory: str):
    self.directory = directory
    self.files = _weight_files(directory)
    self._open: dict[str, Any] = {}

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handle(name).get_slice(name).get_shape())

  def _handle(self, name: str):
    if name not in self.files:
      raise UsageError(f"{self.directory}: the checkpoint has no tensor {name}")
    path = self.files[name]
    if path not in self._open:
      self._open[path] = _open_weights(path)
    return self._open[path]

  def __call__(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    return self._handle(name).get_slice(name)[index]


def _check_shapes(cfg: models.GPTConfig, reader: _Reader, directory: str) -> None:
  """Every tensor the model needs exists with the shape the config implies."""
  flat = hf_map.flatten(jax.tree.map(lambda s: s.shape, models.abstract(cfg)[1]))
  for path, source in hf_map.leaf_sources(cfg).items():
    want = hf_map.hf_shape(source, flat[path][2:] if hf_map.is_stacked(source) else flat[path])
    for name in source.names:
      got = reader.shape(name)
      if got != want:
        raise UsageError(f"{directory}: tensor {name} has shape {list(got)}, but config.json"
                         f" implies {list(want)}")


def load(directory: str, cfg: models.GPTConfig, par: models.Parallelism) -> tuple[Any, Any]:
  """``(graphdef, params)`` of the checkpoint in ``directory``, laid out like
  ``models.init(cfg, par)``'s: each leaf built on the mesh from the slices of its devices."""
  reader = _Reader(directory)
  _check_shapes(cfg, reader, directory)
  graphdef, shapes = models.abstract(cfg, par)
  sources = hf_map.leaf_sources(cfg)

  def build(path, struct):
    source = sources["/".join(str(getattr(k, "key", k)) for k in path)]

    def read(index):
      return hf_map.read_leaf(source, index, struct.shape, par.pp, par.virtual_stages, reader)

    if par.mesh is None:
      return jax.device_put(read(tuple(slice(None) for _ in struct.shape)))
    return jax.make_array_from_callback(struct.shape, struct.sharding, read)

  return graphdef, jax.tree_util.tree_map_with_path(build, shapes)


def save(directory: str, cfg: models.GPTConfig, params: Any, base_config: dict | None = None,
         tokenizer_from: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes host ``params`` (blocks in layer order) as a Hugging Face checkpoint into
  ``directory``, which must not exist: everything goes to a temporary directory beside it,
  renamed into place only when complete. Returns the files written."""
  if os.path.exists(directory):
    raise UsageError(f"{directory} already exists; choose a new --output directory")
  config = hf_map.to_hf_config(cfg, base_config)
  tensors = hf_map.to_hf_tensors(cfg, params)
  nbytes = hf_map.hf_nbytes(cfg, params)
  parent = os.path.dirname(os.path.abspath(directory))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
  try:
    with open(os.path.join(tmp, CONFIG), "w") as f:
      json.dump(config, f, indent=2)
    _write_weights(tmp, tensors, nbytes, max_shard_bytes)
    for name in TOKENIZER_FILES if tokenizer_from else ():
      if os.path.isfile(os.path.join(tokenizer_from, name)):
        shutil.copy(os.path.join(tokenizer_from, name), tmp)
    # mkdtemp's directory is private (0700), and safetensors writes 0600 files: give the
    # export the modes of any file the user creates.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    os.rename(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return sorted(os.listdir(directory))


def _write_weights(directory: str, tensors: dict, nbytes: dict[str, int], max_shard_bytes: int) -> None:
  """Writes ``tensors`` (name -> a function making the array) in files of at most
  ``max_shard_bytes`` (a tensor larger than that alone), one file's arrays at a time."""
  total = sum(nbytes.values())
  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  shards: list[list[str]] = [[]]
  size = 0
  for name in tensors:
    if size and size + nbytes[name] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes[name]
  weight_map = {}
  for k, names in enumerate(shards, 1):
    file = SINGLE if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
    save_file({n: tensors[n]() for n in names}, os.path.join(directory, file), metadata=metadata)
    weight_map.update(dict.fromkeys(names, file))
  if len(shards) == 1:
    return
  with open(os.path.join(directory, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def copy_tokenizer(source: str, run_dir: str) -> None:
  """Copies ``source``'s tokenizer files into ``RUN_DIR/tokenizer`` (once; atomically)."""
  target = os.path.join(run_dir, RUN_TOKENIZER)
  names = [n for n in (*TOKENIZER_FILES, CONFIG) if os.path.isfile(os.path.join(source, n))]
  if os.path.isdir(target) or not names:
    return
  tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=run_dir)
  for name in names:
    shutil.copy(os.path.join(source, name), tmp)
  os.chmod(tmp, 0o755)
  os.rename(tmp, target)


def own_tokenizer_dir(run_dir: str) -> str | None:
  """The run's copy of its tokenizer files (``RUN_DIR/tokenizer``), or None before it has one."""
  own = os.path.join(run_dir, RUN_TOKENIZER)
  return own if os.path.isdir(own) else None


def tokenizer_dir(run_dir: str, init_from: str | None) -> str | None:
  """Where a run's tokenizer files are: its copy, else its --init-from folder or Hub id's
  snapshot (runs saved before the copy), else None (the byte tokenizer)."""
  return own_tokenizer_dir(run_dir) or (hub.local_dir(init_from[len("hf:"):]) if init_from else None)


def load_tokenizer(directory: str | None):
  """``directory``'s tokenizer when it has a tokenizer.json, else the byte tokenizer."""
  has_own = directory is not None and os.path.isfile(os.path.join(directory, "tokenizer.json"))
  return hf_tokenizer.load(directory if has_own else None)
