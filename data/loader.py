"""Grain pipeline: shuffled fixed-length training windows, split over data-parallel shards.

A source's token streams are cut into windows of `seq_len + 1` tokens at stride `seq_len`
(window i of a stream is `stream[i*L : i*L + L + 1]`), so every token is a target exactly
once per epoch; inputs are `window[:-1]`, targets `window[1:]`. Grain samples window ids,
and one vectorized gather per batch reads the tokens:

    per source: range(its window ids) ─ shuffle(seed)
    ─ mix(weights) if a blend ─ [:steps·B] ─ repeat(num_epochs)
    ─ [shard_index::shard_count] ─ batch(B / shard_count) ─ gather tokens

Each epoch is a fresh permutation (Grain folds the epoch into the seed); the tail of an
epoch that does not fill a global batch is dropped. Shard s takes global rows s, s + S,
s + 2S, ... of the permuted stream, so at every step the shards together hold exactly the
global batch `perm[t·B : (t+1)·B]`, whatever their number. The iterator's state
(`{"next_index": step}`) therefore counts global steps: a resumed run, on the same or
another shard count with the same global batch, sees the batches an uninterrupted run
would have.

`ordered_rows` reads the same rows unshuffled, each once, in one array: a fixed
validation set (`train/run/evaluation.py`).
"""
import grain
import numpy as np

from data.errors import DataError
from data.sft import SFTSource
from data.sources import Blend, TokenSource


class Windows:
  """Numbers the windows of `seq_len + 1` tokens of several sources' streams, in order.

  Source k owns the window ids `ranges[k]`; `gather(ids)` reads any batch of them.
  """

  def __init__(self, sources: tuple[TokenSource, ...], seq_len: int):
    if seq_len < 1:
      raise DataError(f"{sources[0].name}: seq_len must be positive, got {seq_len}")
    self.seq_len = seq_len
    self.ranges = []
    self._streams, counts = [], []
    for source in sources:
      n = [max(len(s) - 1, 0) // seq_len for s in source.streams]
      if sum(n) == 0:
        longest = max((len(s) for s in source.streams), default=0)
        raise DataError(f"{source.name}: seq_len {seq_len} needs windows of {seq_len + 1} "
                        f"tokens but the longest token stream has {longest}")
      start = sum(counts)
      self.ranges.append(range(start, start + sum(n)))
      self._streams += source.streams
      counts += n
    self._ends = np.cumsum(counts)
    self._offsets = np.arange(seq_len + 1)

  def __len__(self) -> int:
    return int(self._ends[-1])

  def gather(self, ids) -> np.ndarray:
    """Windows `ids` as int32 [len(ids), seq_len + 1]."""
    ids = np.asarray(ids, dtype=np.int64)
    stream = np.searchsorted(self._ends, ids, side="right")
    starts = (ids - self._ends[stream] + np.diff(self._ends, prepend=0)[stream]) * self.seq_len
    out = np.empty((len(ids), self.seq_len + 1), np.int32)
    for k in np.unique(stream):
      rows = stream == k
      out[rows] = self._streams[k][starts[rows, None] + self._offsets]
    return out


def document_segments(inputs_BxT: np.ndarray, eod: int) -> dict[str, np.ndarray]:
  """Segment ids and positions of windows cut across documents: an EOD token starts the
  next document (as the context of its first token), so attention never crosses an EOD
  and positions restart there. int32 [B, T] each."""
  starts_BxT = inputs_BxT == eod
  starts_BxT[:, 0] = True
  segments_BxT = np.cumsum(starts_BxT, axis=1).astype(np.int32)
  t = np.arange(inputs_BxT.shape[1])
  start_of_BxT = np.maximum.accumulate(np.where(starts_BxT, t, 0), axis=1)
  return {"segment_ids": segments_BxT, "positions": (t - start_of_BxT).astype(np.int32)}


def _grain_seed(seed: int, component: int) -> int:
  # Grain shuffles epoch e with seed + e; hashing keeps runs with seeds s and s + 1 apart.
  return int(np.random.SeedSequence([seed, component]).generate_state(1)[0])


def make_dataset(source: TokenSource | Blend | SFTSource, *, seq_len: int, global_batch_size: int,
                 seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                 num_epochs: int | None = None, shuffle: bool = True,
                 eod: int | None = None) -> grain.MapDataset:
  """The per-shard batch dataset: element t is this shard's part of global step t.

  Args:
    source: from `data.load_source`.
    seq_len: tokens per example; windows hold seq_len + 1.
    global_batch_size: examples per step over all shards (divisible by shard_count).
    seed: shuffle seed (every shard must use the same one).
    shard_index, shard_count: which part of the global batch this process feeds
      (`process_batch_shard` computes them from the batch sharding).
    num_epochs: passes over the data; None repeats forever. For a blend an epoch ends
      when the first source, at its weight, runs out; each source is reshuffled on wrap.
    shuffle: False serves windows in order (e.g. for a fixed validation set).
    eod: with the end-of-document token, windows also carry "segment_ids" and
      "positions" (`document_segments`): each document attends only to itself.

  Returns:
    A `grain.MapDataset` of {"inputs", "targets"}: int32 [global_batch_size /
    shard_count, seq_len]; its length is the number of steps (huge when num_epochs=None).
    A fine-tuning source (`data.sft`) serves its rows, shuffled like windows, with
    "segment_ids" and "positions" too.
  """
  if global_batch_size < 1 or shard_count < 1 or global_batch_size % shard_count:
    raise DataError(f"{source.name}: global batch {global_batch_size} must split evenly "
                    f"over {shard_count} shards")
  if not 0 <= shard_index < shard_count:
    raise DataError(f"{source.name}: shard_index {shard_index} not in [0, {shard_count})")
  if isinstance(source, SFTSource):
    rows = source.rows(seq_len)
    ds = grain.MapDataset.range(len(rows["inputs"]))
    ds = ds.shuffle(seed=_grain_seed(seed, 0)) if shuffle else ds
    gather = lambda ids_B: {k: v[np.asarray(ids_B)] for k, v in rows.items()}  # noqa: E731
    unit = f"rows of {seq_len} tokens"
  else:
    parts = source.sources if isinstance(source, Blend) else (source,)
    windows = Windows(parts, seq_len)
    datasets = []
    for k, ids in enumerate(windows.ranges):
      ds = grain.MapDataset.range(ids.start, ids.stop)
      datasets.append(ds.shuffle(seed=_grain_seed(seed, k)) if shuffle else ds)
    ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, source.weights)

    def gather(ids_B):
      windows_BxL1 = windows.gather(ids_B)
      batch = {"inputs": windows_BxL1[:, :-1], "targets": windows_BxL1[:, 1:]}
      return batch if eod is None else {**batch, **document_segments(batch["inputs"], eod)}

    unit = f"windows of {seq_len + 1} tokens"
  steps = len(ds) // global_batch_size
  if steps == 0:
    raise DataError(f"{source.name}: {len(ds)} {unit} do not fill one global batch of"
                    f" {global_batch_size}")
  if num_epochs is None:
    # "Forever" as a count: Grain's endless repeat has length sys.maxsize, which its
    # batching overflows with one example per batch; 2**48 windows never run out.
    num_epochs = max(1, 2**48 // (steps * global_batch_size))
  ds = ds[:steps * global_batch_size].repeat(num_epochs)
  ds = ds[shard_index::shard_count].batch(global_batch_size // shard_count)
  return ds.map(gather)


def ordered_rows(source: TokenSource | Blend | SFTSource, *, seq_len: int, limit: int | None = None,
                 eod: int | None = None) -> dict[str, np.ndarray]:
  """The first ``limit`` rows (all when None) that ``make_dataset(..., shuffle=False)``
  serves, each once, as one dict of int32 [R, seq_len] (a fixed validation set): a
  fine-tuning file's packed rows in file order, or a token source's windows in order.
  Raises DataError when the source holds no row."""
  every = make_dataset(source, seq_len=seq_len, global_batch_size=1, shuffle=False, num_epochs=1, eod=eod)
  count = len(every) if limit is None else min(limit, len(every))
  return make_dataset(source, seq_len=seq_len, global_batch_size=count, shuffle=False, num_epochs=1, eod=eod)[0]


def make_loader(source: TokenSource | Blend | SFTSource, *, seq_len: int, global_batch_size: int,
                seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                num_epochs: int | None = None, shuffle: bool = True, eod: int | None = None,
                num_threads: int = 4, prefetch: int = 16) -> grain.DatasetIterator:
  """Iterator over `make_dataset(...)` (same arguments) with background prefetch.

  `it.get_state()` is a JSON-serializable dict; `it.set_state(state)` on a fresh
  iterator of the same arguments resumes exactly where the saved one stopped.
  """
  ds = make_dataset(source, seq_len=seq_len, global_batch_size=global_batch_size,
                    seed=seed, shard_index=shard_index, shard_count=shard_count,
                    num_epochs=num_epochs, shuffle=shuffle, eod=eod)
  options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  return iter(ds.to_iter_dataset(options))


def process_batch_shard(sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
  """(shard_index, shard_count) of the batch rows this process's devices hold.

  `sharding` is the global batch's sharding (e.g. NamedSharding(mesh, P(("rp", "fs"))));
  processes that hold the same rows (tensor or pipeline parallel across hosts) get the
  same shard. Feed the loader's batch to `jax.make_array_from_process_local_data`.
  """
  batch = global_shape[0]
  rows = sorted({idx[0].indices(batch)[:2]
                 for idx in sharding.addressable_devices_indices_map(global_shape).values()})
  start, stop = rows[0][0], max(r[1] for r in rows)
  size = stop - start
  covered = sum(b - a for a, b in rows)
  if covered != size or batch % size or start % size:
    raise DataError(f"this process holds batch rows {rows}, not one aligned block of "
                    f"{batch}; choose a mesh whose data-parallel axes are outermost")
  return start // size, batch // size
