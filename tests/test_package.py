"""The package's layers: imports point one way, no cycles, and ``import dion_jax`` neither
changes the process nor loads Pallas."""

import ast
import pathlib
import subprocess
import sys

import dion_jax

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
                  for m in ("pallas_common", "rcqr", "rcqr_sketch", "rcqr_solve", "newton_schulz")}


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
