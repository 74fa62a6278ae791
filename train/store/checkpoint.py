"""Orbax checkpoints that restore onto any mesh.

A checkpoint (one Orbax ``CheckpointManager`` step, written asynchronously and renamed
into place when complete, so a crash mid-save leaves the previous one intact) holds:

- ``state``: the trainer's state (parameters, optimizer state, updates applied, the
  float16 loss scale) as nested dicts of arrays (named tuples flattened to their field
  names), in the mesh-independent layout: stacked block leaves in layer order
  ``(num_layers, ...)`` (``models.to_layers``), and Dion's per-replica momentum with its
  leading rp axis as it is;
- ``meta`` (JSON): step, optimizer updates applied, the data iterator's state, the
  fine-tuning examples consumed (``train/run/loop.py``);
- ``config`` (JSON): the run's Config and the model's GPTConfig.

Restoring reads every array with the new mesh's sharding of its non-stacked dimensions,
then one jitted function re-stacks the layers into the new mesh's pipeline stages and
fits the replica axis to the new rp: kept as it is when rp is unchanged (a bit-identical
resume), else averaged and broadcast (``dion_jax.average_replicas``: only the replicas'
mean momentum matters to the trajectory).

The data iterator's state is saved once as JSON rather than with
``grain.checkpoint.CheckpointSave``, whose files are keyed by the process count: the
loader's state counts global steps (``data/loader.py``), the same on every process, so
one copy restores on any number of processes.

Checkpoints written before the loss scale or the window of ``--skip-spikes`` joined the
state lack ``loss_scale`` or ``spikes``: those subtrees alone (:data:`ADDED_LATER`) restore
as the live state's fresh ones (a fresh window checks no spike before it holds 64 steps);
so do ``--fp8 delayed``'s amax histories (``fp8``) in a checkpoint saved without them (by
``--fp8 current`` or none): they start empty, as a new run's.
Any other missing array is an error, as a checkpoint of another model or optimizer.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dion_jax
import models
from dion_jax.parallel import REPLICA_AXIS
from train.cli import UsageError
from train.store.rundir import existing_steps

# Top-level state fields that older checkpoints lack, restored fresh when absent.
ADDED_LATER = ("loss_scale", "spikes", "fp8")


def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _is_stacked(path) -> bool:
  return "blocks" in _names(path)


def _has_replica_axis(x: jax.Array) -> bool:
  spec = x.sharding.spec
  return len(spec) > 0 and spec[0] == REPLICA_AXIS


def nest(pairs) -> dict:
  """The nested dict of ``(key path, leaf)`` pairs (keys as their names)."""
  out: dict = {}
  for path, leaf in pairs:
    *head, last = _names(path)
    node = out
    for name in head:
      node = node.setdefault(name, {})
    node[last] = leaf
  return out


def lookup(nested: dict, path) -> Any:
  """The value of a nested dict at a key path."""
  for name in _names(path):
    nested = nested[name]
  return nested


def to_saved(tree: Any, pp: int, virtual_stages: int) -> dict:
  """The mesh-independent nested dict of ``tree`` (fresh arrays: safe from donation)."""
  paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(tree))
  replicas = [_has_replica_axis(x) for x in leaves]

  def leaf(path, x, replica):
    # An optimizer state kept in pinned host memory (--offload-optimizer) is laid out on the
    # device, one leaf at a time, and saved from the host as it lives.
    space = jax.typeof(x).memory_space
    x = jax.device_put(x, jax.memory.Space.Device)
    if not _is_stacked(path):
      x = jnp.copy(x)
    elif replica:
      x = jax.vmap(lambda m: models.to_layers(m, pp, virtual_stages))(x)
    else:
      x = models.to_layers(x, pp, virtual_stages)
    return jax.device_put(x, space)

  @jax.jit
  def convert(leaves):
    return nest((p, leaf(p, x, r)) for p, x, r in zip(paths, leaves, replicas))

  return convert(leaves)


def _saved_struct(path, x: jax.Array, saved_shape: tuple[int, ...] | None) -> jax.ShapeDtypeStruct:
  """What to read for live leaf ``x``: the saved shape, sharded like x's non-stacked dims."""
  spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  shape = x.shape
  if _has_replica_axis(x):
    shape, spec = shape[1:], spec[1:]
  if _is_stacked(path):
    shape, spec = (shape[0] * shape[1],) + shape[2:], (None,) + spec[2:]
  name = "/".join(_names(path))
  extra = -1 if saved_shape is None else len(saved_shape) - len(shape)  # 1: a replica axis
  if extra not in (0, 1) or tuple(saved_shape[extra:]) != shape:
    raise UsageError(f"the checkpoint's {name} has shape {saved_shape} but this run needs {shape};"
                     " it was saved by another model or optimizer: pass the flags it was saved"
                     " with (--resume reuses them when left off) or start a new --run-dir")
  if extra:
    spec = (None,) + spec
  return jax.ShapeDtypeStruct(tuple(saved_shape), x.dtype, sharding=NamedSharding(x.sharding.mesh, P(*spec)))


def saved_structs(saved_shapes: Any, like: Any) -> dict:
  """What to read for the live tree ``like`` from a checkpoint whose item metadata is
  ``saved_shapes``: nested ShapeDtypeStructs of the saved shapes (:func:`_saved_struct`)."""

  def struct(path, x):
    try:
      saved_shape = lookup(saved_shapes, path).shape
    except (KeyError, TypeError):
      saved_shape = None
    return _saved_struct(path, x, saved_shape)

  return nest((p, struct(p, x)) for p, x in jax.tree_util.tree_leaves_with_path(like))


def from_saved(saved: dict, like: Any, pp: int, virtual_stages: int) -> Any:
  """Inverse of :func:`to_saved` onto the layout and shardings of the live tree ``like``."""

  paths, targets = zip(*jax.tree_util.tree_leaves_with_path(like))
  replicas = [_has_replica_axis(t) for t in targets]

  def leaf(path, x, target, live_replicas):
    saved_replicas = x.ndim > target.ndim - live_replicas - _is_stacked(path)
    if saved_replicas and not live_replicas:
      x = x.mean(0)
    elif live_replicas and not saved_replicas:
      x = jnp.broadcast_to(x[None], (target.shape[0],) + x.shape)
    elif live_replicas and x.shape[0] != target.shape[0]:
      x = dion_jax.average_replicas(x, target.shape[0])
    if _is_stacked(path):
      to_stages = lambda m: models.to_stages(m, pp, virtual_stages)  # noqa: E731
      x = jax.vmap(to_stages)(x) if live_replicas else to_stages(x)
    return x.astype(target.dtype)

  def convert(saved):
    leaves = [leaf(p, lookup(saved, p), t, r) for p, t, r in zip(paths, targets, replicas)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)

  shardings = jax.tree.map(lambda t: t.sharding, like)
  return jax.jit(convert, out_shardings=shardings)(saved)


class SaveError(Exception):
  """A checkpoint save that failed (disk full, permissions...), surfaced by Orbax's
  background thread at the next call; the message is one line with the cause."""

  def __init__(self, step: int | None, directory: str, error: BaseException):
    cause = error
    while cause is not None and not isinstance(cause, OSError):
      cause = cause.__cause__ or cause.__context__
    # TensorStore's write errors name the OS error by its number and the file in quotes.
    code, path = re.search(r"os_error_code='(\d+)'", str(error)), re.search(r'writing: "([^"]+)"', str(error))
    if cause is None and code:
      reason = os.strerror(int(code[1])) + (f" ({path[1]})" if path else "")
    elif cause is None:
      reason = f"{type(error).__name__}: {error}".splitlines()[0]
    else:
      reason = f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")
    # No OS error behind it: a runtime error, in several processes maybe a lost peer's doing.
    self.no_os_error = cause is None and not code
    kept = existing_steps(directory)
    intact = f"the checkpoint of step {max(kept)} is intact" if kept else "no earlier checkpoint exists"
    super().__init__(f"saving the checkpoint of step {step} to {directory} failed: {reason}; {intact};"
                     " free space or fix permissions there, then --resume")


class _QuietSaveThreads(logging.Filter):
  """Drops Orbax's own warnings and error logs (tracebacks of its save threads, a damaged
  checkpoint's missing files): the error reaches the trainer as one line (:class:`SaveError`,
  ``train.run.preflight.damaged``). Keeps the error of a background write that failed
  (``failure``): in a multi-process run Orbax's threads then wait at barriers for the other
  processes (up to its timeout, minutes), and only its log tells of it at once."""

  failure: BaseException | None = None

  def filter(self, record: logging.LogRecord) -> bool:
    orbax = record.levelno >= logging.WARNING and f"{os.sep}orbax{os.sep}" in record.pathname
    if orbax and record.exc_info and record.pathname.endswith("async_checkpointer.py"):
      self.failure = self.failure or record.exc_info[1]
    return not orbax


_QUIET = _QuietSaveThreads()


def quiet_orbax_logs() -> None:
  """Drops Orbax's own warning and error logs from here on (:class:`_QuietSaveThreads`): a
  damaged file it reads past (a truncated ``_CHECKPOINT_METADATA``) is no log line beside
  the run's own."""
  logging.getLogger("absl").addFilter(_QUIET)


def _closed_loop_callback(error: BaseException | None, tb) -> bool:
  """Whether ``error`` is what TensorStore reports (``PyErr_Print``, ``PyErr_WriteUnraisable``)
  when writes of a failed save complete after Orbax closed that save's event loop: a
  ``RuntimeError('Event loop is closed')`` of ``call_soon_threadsafe`` called from C++ (no
  Python frame above it), a dozen tracebacks per failed save."""
  return (type(error) is RuntimeError and str(error) == "Event loop is closed" and tb is not None
          and tb.tb_frame.f_code.co_name == "call_soon_threadsafe")


def _quiet_hooks() -> None:
  """``sys.excepthook`` and ``sys.unraisablehook`` without :func:`_closed_loop_callback`'s reports."""
  if getattr(sys.excepthook, "quiet", False):
    return
  excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

  def quiet_excepthook(kind, error, tb):
    if not _closed_loop_callback(error, tb):
      excepthook(kind, error, tb)

  def quiet_unraisablehook(unraisable):
    if not _closed_loop_callback(unraisable.exc_value, unraisable.exc_traceback):
      unraisablehook(unraisable)

  quiet_excepthook.quiet = True
  sys.excepthook, sys.unraisablehook = quiet_excepthook, quiet_unraisablehook


class Checkpoints:
  """The run's ``CheckpointManager``: async saves, the newest ``keep`` kept, unfinished
  saves of a killed run removed on start. A failed save raises :class:`SaveError` at the
  first :meth:`check_for_errors` (after each step) once its background write has ended."""

  def __init__(self, directory: str, keep: int, create: bool):
    self.directory = directory
    self.saving: int | None = None  # the step of the last save started
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=True,
                                           cleanup_tmp_directories=True)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    quiet_orbax_logs()
    self.manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    _QUIET.failure = None
    _quiet_hooks()

  def _guarded(self, call) -> Any:
    try:
      return call()
    except Exception as e:  # noqa: BLE001  Orbax re-raises its thread's error as it was
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001  the first error is the one to report
        pass
      raise SaveError(self.saving, self.directory, e) from e

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict, meta: dict, config: dict) -> None:
    self._failed_elsewhere()
    self._guarded(self.manager.wait_until_finished)  # Orbax waits anyway: its error is the last save's
    self.saving = step
    self._guarded(lambda: self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
        config=ocp.args.JsonSave(config))))

  def check_for_errors(self) -> None:
    """Raises SaveError if the last asynchronous save has ended and failed; never waits for
    one still running. (Orbax's own ``check_for_errors`` misses the error: its finalize
    thread takes it first and keeps it for the next ``wait_until_finished``.)"""
    self._failed_elsewhere()
    if self.saving is not None and not self.manager.is_saving_in_progress():
      self._guarded(self.manager.wait_until_finished)  # the save's threads are ending: no wait

  def _failed_elsewhere(self) -> None:
    """Raises SaveError for a write of this process that failed while another process's went
    on (Orbax's threads wait at its barriers, not to be joined)."""
    if _QUIET.failure is not None and jax.process_count() > 1:
      raise SaveError(self.saving, self.directory, _QUIET.failure)

  def read_json(self, step: int) -> tuple[dict, dict]:
    """The ``meta`` and ``config`` of checkpoint ``step``."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
    return out["meta"], out["config"]

  def restore_state(self, step: int, like: Any, pp: int, virtual_stages: int) -> Any:
    """The saved state laid out like ``like`` (a live ``TrainState`` on the new mesh);
    fields of :data:`ADDED_LATER` that the checkpoint lacks keep ``like``'s values."""
    shapes = self.manager.item_metadata(step)["state"]
    absent = {name: getattr(like, name) for name in ADDED_LATER if name not in shapes}
    like = like._replace(**dict.fromkeys(absent))
    target = saved_structs(shapes, like)
    saved = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return from_saved(saved["state"], like, pp, virtual_stages)._replace(**absent)

  def close(self) -> None:
    """Waits for the pending save (SaveError if it failed) and stops Orbax's threads."""
    self._guarded(self.manager.wait_until_finished)
    self.manager.close()
