"""``.ci/run``: the Python 3.12 subset names tests that exist (a renamed test or a new
parameter changes an id, and pytest then runs none of the subset: CI fails after its whole
3.11 part)."""
import os
import re
import subprocess
import sys

from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_jax_subset_names_existing_tests():
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    block = re.search(r"^JAX_SUBSET=\((.*?)^\)", f.read(), re.S | re.M).group(1)
  ids = [i.strip('"') for i in re.findall(r'"[^"]+"|\S+', block)]
  assert len(ids) > 20, ids
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                        *ids], cwd=ROOT, capture_output=True, text=True, env=xla_env.subprocess_env())
  assert out.returncode == 0 and "ERROR" not in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
