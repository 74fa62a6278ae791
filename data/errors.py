"""Errors raised for bad data: one line that names the file and the problem.

Both classes are `ValueError`s, so callers can catch bad input with one clause; a missing
path is also a `FileNotFoundError`. `python -m data.convert` prints them as `error: ...`.
"""


class DataError(ValueError):
  """A data file or source spec that cannot be used (wrong format, size, length...)."""


class DataFileNotFoundError(FileNotFoundError, DataError):
  """A data path (file, shard glob, dataset prefix, directory) that does not exist."""
