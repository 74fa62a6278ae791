"""What the trainer's step sends (``train/run/comm.py``), read from the step ``train.run.setup.setup``
compiles (scan, clipping, guard, update; loops counted per run): equal to
``train.plan`` per group of mesh axes on every kind of mesh, and over the replicas
to what Dion's compressed sync should send, counted by hand from the parameters' shapes.

Each case sets up the trainer once (module cache) with ``tiny`` (or ``tiny-moe``), shrunk
but where Dion's ratio to AdamW is checked, and a global batch of 8, as a user would; set-up
compiles the step, and its record in ``config.json`` is what the tests read.
"""
import functools
import json
import math
import os
import tempfile

import jax
import pytest
from jax.sharding import PartitionSpec as P

import dion_jax
import models
from train.run.plan import planner as plan_lib
from train.run import comm, grad_norm, setup
from train.run import config as config_lib

BATCH = 8
# Achieved: every group within 0.01% but for the scalars of the loss, the guard and the
# norm (tens of bytes; the slack). The bound is 2%.
RTOL, SLACK = 0.02, 128


# The plan's cases shrink the preset's width and length (64, 32 tokens; 4 layers, so that a
# pipeline stage holds more than one, as it does in practice), but for rp=8's, whose Dion and
# AdamW steps the floor below compares at the preset's width (a compile costs the same).
SHRUNK = ("--hidden-size", "64", "--num-attention-heads", "2", "--seq-len", "32")


@functools.cache
def trainer_step(preset: str, mesh: str, optimizer: str, rank: float = 0.25, flags: tuple[str, ...] = ()) -> dict:
  """``config.json``'s record of a run set up with these flags (nothing trained)."""
  with tempfile.TemporaryDirectory(prefix="test_train_comm_") as run_dir:
    cfg = config_lib.parse(["--preset", preset, "--mesh", mesh, "--optimizer", optimizer,
                            "--global-batch-size", str(BATCH), "--dion-rank-fraction", str(rank),
                            "--eval-tokens", "0", "--run-dir", run_dir, *flags])
    run = setup.setup(cfg)
    run.directory.close()
    with open(os.path.join(run_dir, "config.json")) as f:
      return json.load(f)


def _compiled(record) -> dict[tuple[str, ...], dict[str, int]]:
  by_axes = record["communication"]["bytes_per_device_and_step"]
  assert "loops_counted_once" not in by_axes
  return {tuple(axes.split(",")): b for axes, b in by_axes.items()}


def _planned(record) -> dict[tuple[str, ...], int]:
  train = record["train"]
  sizes = dion_jax.parse_mesh_spec(train["mesh"])
  plan = plan_lib.plan(models.GPTConfig(**record["model"]), sizes, train["optimizer"],
                       rank_fraction=train["dion_rank_fraction"], global_batch=BATCH, dtype=record["model"]["dtype"],
                       compare=False, split_q=train["dion_split_q"])
  return {tuple(axes.split(",")): b for axes, b in plan["bytes_by_axes"].items()}


def _wire_over_replicas(record) -> int:
  return sum(b["wire"] for axes, b in _compiled(record).items() if "rp" in axes)


MESHES = {"rp": "rp=8", "rp x fs": "rp=4,fs=2", "rp x fs x tp": "rp=2,fs=2,tp=2", "fs x tp": "fs=4,tp=2",
          "cp": "fs=2,cp=2,tp=2", "ep": "ep=2,fs=2,tp=2", "pp beside batch axes": "pp=2,fs=2,tp=2",
          "pp beside rp": "rp=2,fs=2,pp=2", "fs x tp, Q split over tp": "fs=4,tp=2"}
# Kinds set up with more flags than the mesh: Q's all-gather over tp (--dion-split-q).
FLAGS = {"fs x tp, Q split over tp": ("--dion-split-q",)}
# Dion on every kind of mesh at rank 1/4 (compressed), and on rp at full rank (the gradient
# averaged). Muon and Dion2 average their gradients over rp as AdamW does (AdamW's rp and
# rp x fs cases hold that path); what differs from Dion is their own update's collectives,
# which depend on how a matrix is split (fs x tp, experts over ep, stages over pp) and not
# on the model's, which Dion's cases hold on every mesh. Both run on the same frame of
# blocks (``dion_jax.optimizers.orthogonal``): Muon takes the experts over ep and the stages
# over pp, Dion2 (its selection's collectives beside) cp's mesh, whose matrices are split
# over cp·fs x tp (fs x tp alone: NorMuon's update in test_train_plan.py). AdamW where the
# replicas' tests compare with it; its model's collectives on the other meshes are the others'.
CASES = ([(kind, "dion", 0.25) for kind in MESHES] + [("rp", "dion", 1.0)]
         + [(kind, "muon", 0.25) for kind in ("ep", "pp beside batch axes")] + [("cp", "dion2", 0.25)]
         + [("rp", "adamw", 0.25), ("rp x fs", "adamw", 0.25)])


def setup_record(kind: str, optimizer: str, rank: float = 0.25) -> dict:
  """The record of a case's set-up: every test here reads these (one compile each)."""
  return trainer_step("tiny-moe" if kind == "ep" else "tiny", MESHES[kind], optimizer, rank,
                      flags=(() if kind == "rp" else SHRUNK) + FLAGS.get(kind, ()))


def _assert_plan_matches(kind, optimizer, rank=0.25):
  record = setup_record(kind, optimizer, rank)
  planned, compiled = _planned(record), {axes: b["payload"] for axes, b in _compiled(record).items()}
  for axes in set(planned) | set(compiled):
    got, want = compiled.get(axes, 0), planned.get(axes, 0)
    assert abs(got - want) <= max(RTOL * got, SLACK), (axes, want, got)


@pytest.mark.parametrize("kind,optimizer,rank", CASES)
def test_trainer_step_sends_what_the_plan_says(kind, optimizer, rank):
  """Fails on the step before issue 37: the norm of the replicas' mean gradient all-reduced
  every Dion gradient over rp (rp x fs x tp: 7.5% over the plan); the pipeline embedded
  each micro-batch in its own iteration, gathering the table over fs and reducing its
  gradient and the embeddings' over fs and pp every iteration (pp: 18%)."""
  _assert_plan_matches(kind, optimizer, rank)


def _replica_formula(record: dict) -> int:
  """Bytes each device sends over rp per step by a ring all-reduce of what its replica
  must share: its shard of every gradient, but for each Dion matrix whose (m + n)·r < m·n
  (microsoft/dion's compressed_all_reduce) its share of P and R, (m + n)·r numbers split
  like the matrix; a float32 loss; with Dion, the gradient norm's sketch (k + 1 float32,
  ``train/run/grad_norm.py``). Counted from the shapes and specs alone."""
  train = record["train"]
  sizes, optimizer, rank = dion_jax.parse_mesh_spec(train["mesh"]), train["optimizer"], train["dion_rank_fraction"]
  _, params = models.abstract(models.GPTConfig(**record["model"]))
  specs, labels = models.param_specs(params), dion_jax.default_labels(params)
  total = 4 + (4 * (grad_norm.SKETCH_SIZE + 1) if optimizer == "dion" else 0)  # the loss, the norm's sketch
  for p, spec, label in zip(*(jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, P)) for t in (params, specs, labels))):
    values = math.prod(p.shape)
    if optimizer == "dion" and label == "dion":
      m, n = p.shape[-2:]
      r = dion_jax.dion_rank(rank, 1, m, n)
      if (m + n) * r < m * n:
        values = math.prod(p.shape[:-2]) * (m + n) * r
    total += 4 * values // math.prod(sizes[a] for a in dion_jax.parallel.axis_names(*spec))
  return 2 * (sizes["rp"] - 1) * total // sizes["rp"]


REPLICA_CASES = [("rp", "dion", 0.25), ("rp", "dion", 1.0), ("rp", "adamw", 0.25),
                 ("rp x fs", "dion", 0.25), ("rp x fs", "adamw", 0.25)]


@pytest.mark.parametrize("kind,optimizer,rank", REPLICA_CASES)
def test_the_replicas_exchange_what_they_must(kind, optimizer, rank):
  """Over rp, Dion sends the P and R of its compressed matrices ((m + n)·r per matrix, split
  over fs) and the other gradient shards; at full rank, where P and R would save nothing,
  the gradient, as AdamW does. Achieved within 60 bytes (scalars)."""
  record = setup_record(kind, optimizer, rank)
  wire, want = _wire_over_replicas(record), _replica_formula(record)
  assert abs(wire - want) <= 1e-3 * want + SLACK, (wire, want)


def test_dion_at_rank_one_quarter_sends_less_than_adamw():
  """The issue's floor, whole trainer step, wire bytes over rp, trip counts. Achieved, tiny,
  batch 8: rp=8 0.445x AdamW's (before issue 37: 1.33x: the norm of the replicas' mean
  gradient all-reduced every gradient). The preset's width: at SHRUNK's, the embeddings
  weigh more (0.501x). rp=4,fs=2 (0.446x; before, 1.63x: P's mean over rp was taken on the
  whole P of every fs rank) is held to the byte by the replicas' formula above."""
  dion, adamw = (_wire_over_replicas(setup_record("rp", o)) for o in ("dion", "adamw"))
  assert dion <= 0.5 * adamw, dion / adamw


def test_the_log_and_config_say_what_a_step_sends():
  """One line per group of mesh axes with the compiled step's bytes, and Dion's replica
  sync per group of matrices: compressed at rank 1/4, the gradient at full rank; and the
  gradient norm the step clips by: Dion's replicas' sketch, AdamW's exact."""
  assert setup_record("rp", "dion")["grad_norm"] == "sketch"
  assert setup_record("rp", "adamw")["grad_norm"] == "exact"
  for rank, compressed in ((0.25, True), (1.0, False)):
    record = setup_record("rp", "dion", rank)["communication"]
    groups = record["dion_replica_sync"]
    assert groups and all(g["compressed"] == compressed for g in groups)
    assert sum(len(g["parameters"]) for g in groups) == 6  # the stacked q, k, v, out, up and down kernels
    lines = comm.lines(record, dion_jax.make_mesh("rp=8"))
    rp = record["bytes_per_device_and_step"]["rp"]
    size = lambda n: f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.2f} kB"  # noqa: E731  (here 10 kB..10 MB)
    assert lines[0].startswith(f"communication over rp: {size(rp['payload'])} payload, {size(rp['wire'])}"
                               " on the wire per device and step")
    assert ("P and R averaged" in lines[-1]) == compressed
