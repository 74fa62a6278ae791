"""The package's layers: imports point one way, no cycles, and ``import dion_jax`` neither
changes the process nor loads Pallas; the wheel holds the packages and every command the
README and docs/ name."""

import ast
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

import dion_jax
from tests import xla_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dion_jax"
# Layer -> the layers its modules may import (besides their own).
ALLOWED = {
    "validation": set(),
    "kernels": set(),
    "parallel": set(),
    "linalg": {"validation", "kernels", "parallel"},
    "optimizers": {"validation", "kernels", "parallel", "linalg"},
    "accounting": {"parallel"},
}
PALLAS_MODULES = {f"dion_jax.kernels.{m}"
                  for m in ("pallas_common", "rcqr", "rcqr_sketch", "rcqr_solve", "newton_schulz", "cholesky")}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
  """The dion_jax modules a file imports, inside functions too."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("dion_jax")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dion_jax"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if (PACKAGE / sub.split(".", 1)[1].replace(".", "/")).exists()
                  or (PACKAGE / (sub.split(".", 1)[1].replace(".", "/") + ".py")).exists() else node.module)
  return found


def _graph() -> dict[str, set[str]]:
  return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str:
  return module.split(".")[1] if module.count(".") else "facade"


def test_imports_point_down_the_layers():
  for module, imports in _graph().items():
    if module == "dion_jax":
      continue
    layer = _layer(module)
    for target in imports:
      assert target != "dion_jax", f"{module} imports the package facade"
      assert _layer(target) in ALLOWED[layer] | {layer}, f"{module} ({layer}) imports {target}"


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, int] = {}

  def visit(module, stack):
    state[module] = 1
    for target in graph.get(module, ()):
      assert state.get(target) != 1, "import cycle: " + " -> ".join(stack + [target])
      if target not in state:
        visit(target, stack + [target])
    state[module] = 2

  for module in graph:
    if module not in state:
      visit(module, [module])


def test_pallas_modules_are_reached_only_through_the_backend_choice():
  for module, imports in _graph().items():
    if module in PALLAS_MODULES or module == "dion_jax.kernels.backend":
      continue
    assert not imports & PALLAS_MODULES, f"{module} imports {imports & PALLAS_MODULES}"


def test_models_use_only_dion_jax_parallel():
  for path in (ROOT / "models").glob("*.py"):
    for target in _imports(path):
      assert target == "dion_jax.parallel" or target.startswith("dion_jax.parallel."), f"{path.name}: {target}"


def test_import_changes_nothing_in_the_process():
  # jax itself sets two environment variables when imported: import it first.
  code = ("import os, sys, jax; e = dict(os.environ); import dion_jax; assert e == dict(os.environ), "
          "set(os.environ.items()) ^ set(e.items()); bad = [m for m in sys.modules if 'pallas' in m]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_public_name_resolves():
  assert len(dion_jax.__all__) == len(set(dion_jax.__all__)) == 47
  assert all(hasattr(dion_jax, name) for name in dion_jax.__all__)


# What the wheel holds: the four packages, not the repository's tests and benchmarks.
WHEEL_PACKAGES = {"dion_jax", "models", "train", "data"}


@pytest.mark.slow
def test_every_readme_command_runs_from_the_wheel(tmp_path):
  """The wheel built from this tree, installed into a venv (the dependencies from this
  environment, the package from the wheel alone), run from a directory that is not the
  checkout: every ``python -m train.*`` / ``data.*`` the README and docs/ name is the wheel's, and
  the planner, GRPO and the GPU evidence start (``--help``; exit 2 with one line on CPU).

  The venv sees this environment's packages through a ``.pth`` file naming its
  site-packages, whether it is a venv or not: ``--system-site-packages`` would give it the
  base interpreter's instead, where a venv's dependencies are not. The file lists plain
  paths, so the ``.pth`` files there (this checkout's own editable install) do not run, and
  it is written after the wheel's install, so that pip there never sees this environment's
  packages as its own to replace."""
  source = tmp_path / "source"  # a copy, so that setuptools' build/ lands outside the checkout
  source.mkdir()
  for name in ("pyproject.toml", "README.md", *WHEEL_PACKAGES):
    copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
    copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
                  str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
  (wheel,) = (tmp_path / "dist").glob("dion_jax-*.whl")
  with zipfile.ZipFile(wheel) as z:
    tops = {name.split("/")[0] for name in z.namelist()}
  assert {t for t in tops if not t.endswith(".dist-info")} == WHEEL_PACKAGES
  venv = tmp_path / "venv"
  env = xla_env.subprocess_env(drop=("PYTHONPATH",))  # a checkout on it would pass for the package
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  python = str(venv / "bin" / "python")
  subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                 check=True, capture_output=True, env=env)
  (venv_site,) = (venv / "lib").glob("python3.*/site-packages")
  assert (venv_site / "train" / "gpt.py").is_file()
  ours = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
  (venv_site / "running_environment.pth").write_text("".join(f"{path}\n" for path in ours))
  user = tmp_path / "elsewhere"
  user.mkdir()
  documented = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
  commands = sorted(set(re.findall(r"python -m ((?:train|data)\.\w+)", documented)))
  assert {"train.gpt", "train.grpo", "train.plan", "train.gpu", "train.eval", "train.export"} <= set(commands)
  prefixes = {m.split(".")[0] for m in re.findall(r"python -m (\w+)", documented)}
  # benchmarks: the checkout's own measurements; pytest and build: the tools
  assert prefixes == {"train", "data", "benchmarks", "pytest", "build"}, prefixes
  where = subprocess.run([python, "-c", "import importlib.util, sys; print('\\n'.join(importlib.util.find_spec(m).origin"
                          " for m in sys.argv[1:]))", *commands], cwd=user, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
  assert len(where) == len(commands) and all(w.startswith(str(venv)) for w in where), where
  for module in ("train.plan", "train.grpo"):
    out = subprocess.run([python, "-m", module, "--help"], cwd=user, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: python -m {module}"), out.stderr[-2000:]
  out = subprocess.run([python, "-m", "train.gpu"], cwd=user, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                       text=True)
  assert out.returncode == 2 and out.stderr.startswith("error: no GPU here") and out.stderr.count("\n") == 1, out.stderr
  assert os.listdir(user) == []  # nothing written where the commands ran
