"""A run's checkpoint as a Hugging Face checkpoint: ``python -m train.export RUN_DIR --output DIR``
(and ``--push-to-hub ORG/NAME`` to upload it: ``train/store/hub.py``).

Writes ``config.json`` (the imported checkpoint's, with the model's fields written over it,
when the run started from ``--init-from hf:DIR``), the weights as ``model.safetensors`` (or
shards and ``model.safetensors.index.json`` above ``--max-shard-bytes``) and, for a run
from a Hugging Face checkpoint, its tokenizer files. Only Llama-, Qwen3- and Qwen3-MoE-shaped
models export (``models/hf.py``). Atomic: the files go to a temporary directory beside DIR,
renamed to DIR only when complete, so a failed export leaves nothing.

Streamed: the checkpoint is read one parameter (a stacked leaf: all layers of one weight)
at a time, so the host holds that leaf and one output file's tensors, not the model.

With ``--push-to-hub`` the folder is uploaded as one commit to that model repository
(created, private with ``--private``, when missing; ``HF_TOKEN`` or ``huggingface-cli
login`` authenticates); without ``--output`` it is written to a temporary folder, removed
after the upload.

Bad input prints one ``error: ...`` line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from models import hf as hf_map
from train import cli
from train.cli import UsageError
from train.run import preflight
from train.run import restore as restore_lib
from train.store import checkpoint as ckpt_lib
from train.store import hf as hf_io
from train.store import hub, rundir


def export(run_dir: str, output: str, step: int | None = None,
           max_shard_bytes: int = hf_io.MAX_SHARD_BYTES) -> list[str]:
  """Exports checkpoint ``step`` (the latest when None) of ``run_dir`` to ``output``;
  returns the files written."""
  run_dir = os.path.abspath(run_dir)
  if os.path.exists(output):
    raise UsageError(f"{output} already exists; choose a new --output directory")
  with restore_lib.open_checkpoint(run_dir, step) as (manager, step, cfg):
    try:
      hf_map.to_hf_config(cfg)
    except hf_map.UnsupportedCheckpoint as e:
      raise UsageError(str(e)) from None
    # The record saved with the step itself: config.json may be newer, damaged or gone.
    with preflight.reading("--step", str(manager.directory), step):
      record = rundir.checkpoint_record(str(manager.directory), step)
      tokenizer_from = hf_io.tokenizer_dir(run_dir, record["train"].get("init_from"))
      leaves = _Leaves(manager, step)
    return hf_io.save(output, cfg, leaves.tree(), record.get("hf_config"), tokenizer_from, max_shard_bytes)


class _Leaves:
  """A checkpoint's parameters, each leaf read from disk when first sliced and only the
  last one kept. The export makes its tensors leaf by leaf (``models.hf.to_hf_tensors``),
  so it holds one leaf and one file's tensors, not the model."""

  def __init__(self, manager, step: int):
    self._manager, self._step = manager, step
    self._shapes = manager.item_metadata(step)["state"]["params"]
    self._path: tuple | None = None
    self._leaf: np.ndarray | None = None

  def tree(self) -> Any:
    """The parameters' tree of :class:`_Leaf` s (blocks in layer order, as saved)."""
    def leaf(path, metadata):
      return _Leaf(self, path, tuple(metadata.shape))

    return jax.tree_util.tree_map_with_path(leaf, self._shapes)

  def read(self, path: tuple) -> np.ndarray:
    """The leaf at key path ``path``, as a host array."""
    if path != self._path:
      self._path, self._leaf = None, None  # free the last leaf before reading the next
      item = ckpt_lib.nest([(path, ckpt_lib.lookup(self._shapes, path))])
      args = ckpt_lib.nest([(path, ocp.RestoreArgs(restore_type=np.ndarray))])
      with preflight.reading("--step", str(self._manager.directory), self._step):
        state = self._manager.restore(self._step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": item}, restore_args={"params": args}, partial_restore=True)))["state"]
      self._path, self._leaf = path, ckpt_lib.lookup(state["params"], path)
    return self._leaf


class _Leaf:
  """One parameter of :class:`_Leaves`: its shape, and its slices (read on demand)."""

  def __init__(self, leaves: _Leaves, path: tuple, shape: tuple[int, ...]):
    self._leaves, self._path, self.shape = leaves, path, shape

  def __getitem__(self, index) -> np.ndarray:
    return self._leaves.read(self._path)[index]


def _parser() -> argparse.ArgumentParser:
  parser = cli.Parser(prog="python -m train.export",
                      description="Write a run's checkpoint as a Hugging Face checkpoint directory.")
  parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of python -m train.gpt")
  parser.add_argument("--output", metavar="DIR", help="directory to create (must not exist; needed unless"
                                                    " --push-to-hub)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--max-shard-bytes", type=int, default=hf_io.MAX_SHARD_BYTES,
                      help="split the weights into shards of at most this size (default 2 GiB)")
  parser.add_argument("--push-to-hub", metavar="ORG/NAME",
                      help="upload the export to this Hugging Face model repository (needs the hub extra)")
  parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
  return parser


def main(argv: list[str] | None = None) -> int:
  def start():
    args = _parser().parse_args(argv)
    if args.max_shard_bytes < 1:
      raise UsageError(f"--max-shard-bytes must be positive, got {args.max_shard_bytes}")
    if args.output is None and args.push_to_hub is None:
      raise UsageError("--output DIR needed (or --push-to-hub ORG/NAME)")
    if args.push_to_hub is not None:
      hub.check_repo(args.push_to_hub)
    if args.output is not None:
      files = export(args.run_dir, args.output, args.step, args.max_shard_bytes)
      print(f"exported {args.run_dir} to {args.output}: {', '.join(files)}", flush=True)
      return args, files, args.push_to_hub and hub.push(args.output, args.push_to_hub, args.private)
    with tempfile.TemporaryDirectory(prefix="export-") as parent:
      output = os.path.join(parent, args.push_to_hub.split("/")[1])
      files = export(args.run_dir, output, args.step, args.max_shard_bytes)
      return args, files, hub.push(output, args.push_to_hub, args.private)

  def report(done) -> int:
    args, files, url = done
    if url:
      print(f"pushed {', '.join(files)} to {args.push_to_hub}: {url}")
    return 0

  return cli.run(start, report, interrupted="interrupted; nothing was written (the export's folder appears only when"
                                           " complete)")


if __name__ == "__main__":
  cli.exit(main())
