"""The quick-start example trains: its loss falls well below the random-guess level."""

import math
import re

from train import demo


def test_demo_learns(capsys, tmp_path, monkeypatch):
  monkeypatch.setenv("DION_JAX_CACHE", str(tmp_path))
  assert demo.main(["--steps", "60", "--batch-size", "16", "--seq-len", "64"]) == 0
  out = capsys.readouterr().out
  val = float(re.search(r"validation loss ([0-9.]+)", out).group(1))
  assert val < 0.7 * math.log(256)


def test_demo_rejects_bad_rank_fraction(capsys):
  assert demo.main(["--rank-fraction", "2"]) == 2
  assert "rank_fraction" in capsys.readouterr().err
