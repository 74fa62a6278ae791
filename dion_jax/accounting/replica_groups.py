"""The device groups of an HLO collective, read from its attribute text: the three
replica-group formats XLA prints (explicit lists ``{{0,4},{1,5}}``, iota lists
``[4,2]<=[2,2,2]T(0,2,1)``, Shardy's mesh-axes lists ``mesh['axis_0'=4,'axis_1'=2],
device_ids=([4,2]T(1,0)) {'axis_0'}``) and a collective-permute's source-target pairs,
and the mesh axes along which a group's devices differ (``dion_jax.accounting.hlo``
counts bytes by them). Device ids are partition ids: positions in ``mesh.devices.flat``.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import jax
import numpy as np

_INTS_RE = re.compile(r"\d+")
_IOTA_RE = re.compile(r"\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?"
    r"\s*\{(?P<group>[^}]*)\}")
_MESH_AXIS_RE = re.compile(r"'?(?P<name>[^'=\s]+)'?=(?P<size>\d+)")
_AXIS_REF_RE = re.compile(r"'?(?P<name>[^':\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_DEVICE_IDS_IOTA_RE = re.compile(
    r"(?:\[[\d,]+\]<=)?\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def closing(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at text[start]."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 80]!r}")


def split_top_level(text: str) -> list[str]:
  """Splits at commas outside any brackets."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(text):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _attr(attrs: str, key: str) -> str | None:
  """The raw value of `key=` in an attribute list, brackets balanced."""
  m = re.search(rf"(?:^|[\s,]){key}=", attrs)
  if not m:
    return None
  start = m.end()
  if attrs.startswith("mesh[", start):
    mesh_m = _MESH_RE.match(attrs, start)
    if not mesh_m:
      raise ValueError(f"unrecognised mesh replica groups: {attrs[start:start + 120]!r}")
    return mesh_m.group(0)
  if attrs[start] in "{[(":
    end = closing(attrs, start)
    if attrs[start] == "[" and attrs.startswith("<=", end):  # iota list
      iota_m = _IOTA_RE.match(attrs, start)
      if iota_m:
        return iota_m.group(0)
    return attrs[start:end]
  end = attrs.find(",", start)
  return attrs[start:] if end < 0 else attrs[start:end]


def _explicit_groups(text: str, n_devices: int) -> list[list[int]]:
  inner = text[1:-1].strip()
  if not inner:  # {}: one group of every device
    return [list(range(n_devices))]
  groups = []
  for part in split_top_level(inner):
    if not (part.startswith("{") and part.endswith("}")):
      raise ValueError(f"unrecognised replica groups {text!r}")
    groups.append([int(i) for i in _INTS_RE.findall(part)])
  return groups


def _iota_array(reshape: str, perm: str | None, dims: Sequence[int]) -> np.ndarray:
  reshape_dims = [int(d) for d in reshape.split(",")]
  ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
  if perm:
    ids = ids.transpose([int(p) for p in perm.split(",")])
  return ids.reshape(dims)


def _mesh_groups(m: re.Match) -> list[list[int]]:
  """Flattened groups of a Shardy mesh-axes list (XLA's MeshAxesReplicaGroupList)."""
  names, dims = [], []
  for item in split_top_level(m["axes"]):
    axis_m = _MESH_AXIS_RE.fullmatch(item)
    if not axis_m:
      raise ValueError(f"unrecognised mesh axis {item!r} in replica groups {m.group(0)!r}")
    names.append(axis_m["name"])
    dims.append(int(axis_m["size"]))
  if m["ids"] is None:
    ids = np.arange(math.prod(dims)).reshape(dims)
  elif (iota_m := _DEVICE_IDS_IOTA_RE.fullmatch(m["ids"].strip())):
    ids = _iota_array(iota_m["reshape"], iota_m["perm"], dims)
  elif re.fullmatch(r"[\d,\s]+", m["ids"]):
    ids = np.array([int(i) for i in _INTS_RE.findall(m["ids"])]).reshape(dims)
  else:
    raise ValueError(f"unrecognised device_ids in replica groups {m.group(0)!r}")
  # A device's group is given by its coordinates with the grouped axes (or the
  # grouped digits of sub-axes "(pre_size)size", pre_size = product of the
  # sub-axes to the left) zeroed out.
  coords = [c.ravel() for c in np.indices(dims)]
  for ref in split_top_level(m["group"]):
    ref_m = _AXIS_REF_RE.fullmatch(ref)
    if not ref_m or ref_m["name"] not in names:
      raise ValueError(f"unrecognised axis {ref!r} in replica groups {m.group(0)!r}")
    i = names.index(ref_m["name"])
    if ref_m["pre"] is None:
      coords[i] = np.zeros_like(coords[i])
      continue
    pre, size = int(ref_m["pre"]), int(ref_m["size"])
    if dims[i] % (pre * size):
      raise ValueError(f"sub-axis {ref!r} does not divide axis size {dims[i]} in {m.group(0)!r}")
    post = dims[i] // (pre * size)
    coords[i] = coords[i] - (coords[i] // post) % size * post
  groups: dict[tuple[int, ...], list[int]] = {}
  for key, device in zip(zip(*coords), ids.ravel()):
    groups.setdefault(key, []).append(int(device))
  return list(groups.values())


def replica_groups(instr_attrs: str, op: str, n_devices: int) -> list[list[int]]:
  """The device groups of one collective, from its attribute text."""
  if op == "collective-permute":
    if "slice_sizes=" in instr_attrs:
      raise ValueError("in-place collective-permute (slice_sizes=...) is not supported")
    pairs = _attr(instr_attrs, "source_target_pairs")
    if pairs is None:
      raise ValueError(f"collective-permute without source_target_pairs: {instr_attrs[:120]!r}")
    return _explicit_groups(pairs, n_devices) if pairs != "{}" else []
  text = _attr(instr_attrs, "replica_groups")
  if text is None:
    raise ValueError(f"{op} without replica_groups: {instr_attrs[:120]!r}")
  if text.startswith("{"):
    return _explicit_groups(text, n_devices)
  if (iota_m := _IOTA_RE.fullmatch(text)):
    dims = [int(d) for d in iota_m["dims"].split(",")]
    return _iota_array(iota_m["reshape"], iota_m["perm"], dims).reshape(dims[0], -1).tolist()
  if (mesh_m := _MESH_RE.fullmatch(text)):
    return _mesh_groups(mesh_m)
  raise ValueError(f"unrecognised replica_groups format {text!r}")


def group_axes(groups: Iterable[Sequence[int]], mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """Mesh axes along which the devices (positions in mesh.devices.flat) of a group differ."""
  shape = mesh.devices.shape
  varying = np.zeros(len(shape), dtype=bool)
  for group in groups:
    ids = np.asarray(group)
    if ids.size and (ids.min() < 0 or ids.max() >= mesh.devices.size):
      raise ValueError(
          f"replica group {list(group)} names devices outside the mesh of"
          f" {mesh.devices.size}; pass the mesh the function was compiled for")
    coords = np.array(np.unravel_index(ids, shape))
    varying |= (coords != coords[:, :1]).any(axis=1)
  return tuple(a for a, v in zip(mesh.axis_names, varying) if v)
