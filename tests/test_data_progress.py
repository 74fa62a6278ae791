import io

from data.progress import Progress


def test_progress_draws_count_total_and_final_newline():
  out = io.StringIO()
  with Progress("building", total=4, unit="files", interval=0.0, stream=out) as bar:
    bar.update(1)
    bar.update(3)
  lines = out.getvalue().split("\r")[1:]
  assert lines[0].startswith("building: [######..................] 1/4 files")
  assert "[########################] 4/4 files" in lines[-1]
  assert out.getvalue().endswith("\n")


def test_disabled_progress_writes_nothing():
  out = io.StringIO()
  with Progress("x", total=2, interval=0.0, enabled=False, stream=out) as bar:
    bar.update(2)
  assert out.getvalue() == "" and bar.count == 2
