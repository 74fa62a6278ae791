"""A one-line progress bar on stderr (tqdm is not a dependency).

Redraws at most every `interval` seconds, so it costs nothing in tight loops; silent when
`enabled` is false (e.g. under tests or when stderr is not wanted).
"""
import sys
import time


class Progress:
  """`with Progress("tokenizing", total=n, unit="files") as bar: bar.update(1)`."""

  def __init__(self, label, total=None, unit="", enabled=True, interval=0.1, stream=None):
    self.label, self.total, self.unit = label, total, unit
    self.enabled, self.interval = enabled, interval
    self.stream = sys.stderr if stream is None else stream
    self.count = 0
    self._start = self._last = time.perf_counter()

  def update(self, n=1):
    self.count += n
    now = time.perf_counter()
    if self.enabled and now - self._last >= self.interval:
      self._last = now
      self._draw(now)

  def _draw(self, now, end=""):
    elapsed = now - self._start
    if self.total:
      frac = min(self.count / self.total, 1.0)
      filled = int(24 * frac)
      bar = f"[{'#' * filled}{'.' * (24 - filled)}] {self.count:,}/{self.total:,}"
    else:
      bar = f"{self.count:,}"
    self.stream.write(f"\r{self.label}: {bar} {self.unit} ({elapsed:.1f}s){end}")
    self.stream.flush()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.enabled:
      self._draw(time.perf_counter(), end="\n")
