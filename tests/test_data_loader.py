import json

import numpy as np
import pytest

from data import loader
from data.errors import DataError
from data.sources import Blend, TokenSource

L = 4  # seq_len


def _ramp(num_windows, offset=0, name="ramp"):
  """A stream whose window i starts with token offset + i*L, so rows identify windows."""
  return TokenSource(name, (np.arange(num_windows * L + 1, dtype=np.int32) + offset,), None)


def _window_ids(batch, offset=0):
  return ((batch["inputs"][:, 0] - offset) // L).tolist()


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_windows_are_stride_seq_len_and_never_cross_streams():
  a = TokenSource("a", (np.arange(10), np.arange(100, 103), np.arange(200, 209)), None)
  b = TokenSource("b", (np.arange(300, 306),), None)
  w = loader.Windows((a, b), 4)
  # (10-1)//4 = 2, (3-1)//4 = 0, (9-1)//4 = 2 windows for a; (6-1)//4 = 1 for b.
  assert len(w) == 5 and w.ranges == [range(0, 4), range(4, 5)]
  expected = [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [200, 201, 202, 203, 204],
              [204, 205, 206, 207, 208], [300, 301, 302, 303, 304]]
  assert w.gather(range(5)).tolist() == expected
  assert w.gather([4, 0, 3, 0]).tolist() == [expected[i] for i in (4, 0, 3, 0)]
  assert w.gather([1]).dtype == np.int32


def test_batches_are_inputs_and_shifted_targets():
  batch = next(loader.make_loader(_ramp(16), seq_len=L, global_batch_size=8, seed=0))
  assert batch["inputs"].shape == batch["targets"].shape == (8, L)
  assert batch["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
  np.testing.assert_array_equal(batch["inputs"] % L, np.tile(np.arange(L), (8, 1)))


@pytest.mark.parametrize("shard_count", [1, 2, 4, 8])
def test_one_epoch_serves_each_window_exactly_once_over_all_shards(shard_count):
  n, B = 48, 8
  per_step = [[] for _ in range(n // B)]
  for s in range(shard_count):
    it = loader.make_loader(_ramp(n), seq_len=L, global_batch_size=B, seed=3,
                            shard_index=s, shard_count=shard_count, num_epochs=1)
    batches = list(it)
    assert len(batches) == n // B
    for t, b in enumerate(batches):
      assert b["inputs"].shape == (B // shard_count, L)
      per_step[t] += _window_ids(b)
  assert sorted(sum(per_step, [])) == list(range(n))
  # The global batch of each step does not depend on the number of shards.
  reference = [sorted(_window_ids(b)) for b in loader.make_loader(
      _ramp(n), seq_len=L, global_batch_size=B, seed=3, num_epochs=1)]
  assert [sorted(ids) for ids in per_step] == reference


def test_seeds_epochs_and_order():
  def order(seed, epochs=1):
    it = loader.make_loader(_ramp(40), seq_len=L, global_batch_size=8, seed=seed,
                            num_epochs=epochs)
    return sum((_window_ids(b) for b in it), [])
  assert order(0) == order(0)
  assert order(0) != order(1) and order(1) != order(2)
  assert order(0) != list(range(40))
  two = order(0, epochs=2)
  assert len(two) == 80 and two[:40] == order(0)
  assert sorted(two[40:]) == list(range(40)) and two[40:] != two[:40]


@pytest.mark.parametrize("shard_count", [1, 4])
def test_one_example_per_shard_runs_forever_in_global_order(shard_count):
  # A batch row per shard (e.g. one sequence per process) used to overflow Grain's length.
  def ids(batch_size, shards, steps):
    its = [loader.make_loader(_ramp(40), seq_len=L, global_batch_size=batch_size, seed=5,
                              shard_index=s, shard_count=shards) for s in range(shards)]
    return [i for _ in range(steps) for it in its for i in _window_ids(next(it))]
  served = ids(shard_count, shard_count, 120 // shard_count)  # three epochs
  assert served[:40] == ids(8, 1, 5)
  assert all(sorted(served[e * 40:(e + 1) * 40]) == list(range(40)) for e in range(3))


def test_unshuffled_serves_windows_in_order():
  it = loader.make_loader(_ramp(16), seq_len=L, global_batch_size=8, seed=0, shuffle=False,
                          num_epochs=1)
  assert [_window_ids(b) for b in it] == [list(range(8)), list(range(8, 16))]


def test_partial_global_batch_is_dropped_each_epoch():
  ds = loader.make_dataset(_ramp(21), seq_len=L, global_batch_size=8, seed=0, num_epochs=3)
  assert len(ds) == 6  # 2 full steps of 8 out of 21 windows, per epoch
  ids = [_window_ids(ds[t]) for t in range(6)]
  for epoch in range(3):
    seen = sum(ids[2 * epoch:2 * epoch + 2], [])
    assert len(set(seen)) == 16 and set(seen) <= set(range(21))


@pytest.mark.parametrize("k", [0, 1, 5, 7])
def test_resume_from_state_matches_uninterrupted_run(k):
  kwargs = dict(seq_len=L, global_batch_size=8, seed=7)
  uninterrupted = _take(loader.make_loader(_ramp(24), **kwargs), k + 6)
  first = loader.make_loader(_ramp(24), **kwargs)
  _take(first, k)
  state = json.loads(json.dumps(first.get_state()))
  resumed = loader.make_loader(_ramp(24), **kwargs)
  resumed.set_state(state)
  for want, got in zip(uninterrupted[k:], _take(resumed, 6)):
    np.testing.assert_array_equal(want["inputs"], got["inputs"])
    np.testing.assert_array_equal(want["targets"], got["targets"])


def test_resume_onto_more_shards_continues_the_same_global_batches():
  kwargs = dict(seq_len=L, global_batch_size=8, seed=1)
  single = loader.make_loader(_ramp(24), **kwargs)
  _take(single, 4)
  state = single.get_state()
  expected = [sorted(_window_ids(b)) for b in _take(single, 3)]
  got = [[] for _ in range(3)]
  for s in range(2):
    it = loader.make_loader(_ramp(24), shard_index=s, shard_count=2, **kwargs)
    it.set_state(state)
    for t, b in enumerate(_take(it, 3)):
      got[t] += _window_ids(b)
  assert [sorted(g) for g in got] == expected


def test_blend_follows_the_weights_and_reshuffles_each_source():
  a, b = _ramp(30, 0, "a"), _ramp(20, 10_000, "b")
  blend = Blend((a, b), (0.75, 0.25))
  it = loader.make_loader(blend, seq_len=L, global_batch_size=8, seed=0)
  firsts = np.concatenate([x["inputs"][:, 0] for x in _take(it, 25)])  # 200 windows
  from_a = firsts < 10_000
  assert from_a.sum() == 150
  a_ids = (firsts[from_a] // L).tolist()
  b_ids = ((firsts[~from_a] - 10_000) // L).tolist()
  # Each source runs through a full permutation before repeating any window.
  assert sorted(a_ids[:30]) == list(range(30)) and sorted(a_ids[30:60]) == list(range(30))
  assert sorted(b_ids[:20]) == list(range(20)) and a_ids[:30] != a_ids[30:60]


def test_blend_is_deterministic_and_resumable():
  blend = Blend((_ramp(30, 0, "a"), _ramp(20, 10_000, "b")), (0.5, 0.5))
  kwargs = dict(seq_len=L, global_batch_size=4, seed=2)
  full = _take(loader.make_loader(blend, **kwargs), 10)
  it = loader.make_loader(blend, **kwargs)
  _take(it, 6)
  resumed = loader.make_loader(blend, **kwargs)
  resumed.set_state(it.get_state())
  for want, got in zip(full[6:], _take(resumed, 4)):
    np.testing.assert_array_equal(want["inputs"], got["inputs"])


def test_bad_shapes_give_one_line_errors():
  with pytest.raises(DataError, match=r"ramp: seq_len 100 needs windows of 101 tokens but "
                                      r"the longest token stream has 41"):
    loader.make_dataset(_ramp(10), seq_len=100, global_batch_size=1)
  with pytest.raises(DataError, match=r"ramp: 10 windows of 5 tokens do not fill one global "
                                      r"batch of 16"):
    loader.make_dataset(_ramp(10), seq_len=L, global_batch_size=16)
  with pytest.raises(DataError, match="global batch 6 must split evenly over 4 shards"):
    loader.make_dataset(_ramp(10), seq_len=L, global_batch_size=6, shard_count=4)
  with pytest.raises(DataError, match=r"shard_index 4 not in \[0, 4\)"):
    loader.make_dataset(_ramp(10), seq_len=L, global_batch_size=8, shard_index=4,
                        shard_count=4)
  with pytest.raises(DataError, match="empty: seq_len 4 needs windows of 5 tokens but the "
                                      "longest token stream has 0"):
    loader.make_dataset(TokenSource("empty", (), None), seq_len=L, global_batch_size=1)


class _FakeSharding:
  """Stands in for one process's view of a multi-process batch sharding."""

  def __init__(self, rows):
    self.rows = rows

  def addressable_devices_indices_map(self, shape):
    return {d: (slice(a, b), slice(None)) for d, (a, b) in enumerate(self.rows)}


def test_process_batch_shard():
  assert loader.process_batch_shard(_FakeSharding([(8, 12), (12, 16)]), (16, L)) == (1, 2)
  assert loader.process_batch_shard(_FakeSharding([(4, 8), (4, 8)]), (16, L)) == (1, 4)
  with pytest.raises(DataError, match="not one aligned block"):
    loader.process_batch_shard(_FakeSharding([(0, 4), (8, 12)]), (16, L))


def test_process_batch_shard_on_a_single_process_mesh():
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("rp", "fs"))
  sharding = NamedSharding(mesh, P(("rp", "fs"), None))
  assert loader.process_batch_shard(sharding, (16, L)) == (0, 1)


def test_iterator_state_round_trips_through_an_orbax_checkpoint(tmp_path):
  import grain
  import orbax.checkpoint as ocp
  kwargs = dict(seq_len=L, global_batch_size=8, seed=5)
  it = loader.make_loader(_ramp(40), **kwargs)
  _take(it, 3)
  with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
    manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
  expected = _take(it, 2)
  resumed = loader.make_loader(_ramp(40), **kwargs)
  with ocp.CheckpointManager(str(tmp_path), item_names=("data",)) as manager:
    manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
  assert resumed.get_state() == {"next_index": 3}
  for want, got in zip(expected, _take(resumed, 2)):
    np.testing.assert_array_equal(want["inputs"], got["inputs"])


def test_document_segments_restart_at_each_eod():
  import data
  from data.loader import document_segments

  inputs = np.array([[5, 6, 256, 7, 8, 256, 9], [256, 1, 2, 3, 4, 5, 6]])
  out = document_segments(inputs, 256)
  assert out["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]]
  assert out["positions"].tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
  source = data.load_source("stdlib:val", progress=False)
  batch = next(data.make_loader(source, seq_len=64, global_batch_size=2, eod=data.EOD))
  assert set(batch) == {"inputs", "targets", "segment_ids", "positions"}
