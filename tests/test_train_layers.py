"""train/'s floors: imports point down, never across from one command to another, no cycles.

From the top: the commands (``gpt``, ``eval``, ``sample``, ``export``, ``plot``, and the
packages ``grpo``, ``plan``, ``gpu``); ``train.run``, what one training run needs;
``train.store``, what a run writes and reads back; ``train.cli`` at the ground. A command
may import its own package's modules and the floors below, never another command: what
two commands share lives in ``train.run`` or ``train.store``.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train"
FLOORS = ("command", "run", "store", "cli")  # top to bottom
COMMANDS = ("gpt", "eval", "sample", "export", "plot", "grpo", "plan", "gpu")


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str) -> str:
  """The train module ``name`` names: a module, or the package it is an attribute of."""
  parts = name.split(".")
  while parts:
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
      return ".".join(parts)
    parts.pop()
  raise AssertionError(f"{name} is no module of this tree")


def _imports(path: pathlib.Path) -> set[str]:
  """The train modules a file imports, inside functions too."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "train"}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "train":
      found |= {_resolve(f"{node.module}.{a.name}") for a in node.names}
  return found


def _graph() -> dict[str, set[str]]:
  return {_module(p): _imports(p) - {_module(p)} for p in TRAIN.rglob("*.py")}


def _place(module: str) -> tuple[str, str]:
  """(floor, unit) of a train module; a command's unit is its name, a floor's its package."""
  parts = module.split(".")
  if len(parts) == 1:
    return "package", "train"
  if parts[1] in COMMANDS:
    return "command", parts[1]
  assert parts[1] in FLOORS, f"{module} stands on no floor: add it to a package of {FLOORS[1:]} or to COMMANDS"
  return parts[1], parts[1]


def _refusal(importer: str, target: str) -> str | None:
  """Why ``importer`` may not import ``target`` (None: it may)."""
  (floor, unit), (to_floor, to_unit) = _place(importer), _place(target)
  if "package" in (floor, to_floor):
    return "train/__init__.py imports nothing and is imported by nobody" if importer != target else None
  if floor == to_floor == "command" and unit != to_unit:
    return f"the command {unit} imports the command {to_unit}: move what they share down to train.run or train.store"
  if FLOORS.index(to_floor) < FLOORS.index(floor):
    return f"{floor} imports from {to_floor}, a floor above it"
  return None


def test_every_module_stands_on_a_floor():
  assert {_place(m)[0] for m in _graph()} == {"package", *FLOORS}


def test_imports_point_down_and_never_across_commands():
  wrong = [f"{m} -> {t}: {why}" for m, targets in _graph().items() for t in sorted(targets)
           if (why := _refusal(m, t))]
  assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, int] = {}

  def visit(module, stack):
    state[module] = 1
    for target in sorted(graph.get(module, ())):
      assert state.get(target) != 1, "import cycle: " + " -> ".join(stack + [target])
      if target not in state:
        visit(target, stack + [target])
    state[module] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


@pytest.mark.parametrize("importer, target, refused", [
    ("train.eval", "train.gpt", True),  # across: command to command
    ("train.grpo.loop", "train.sample", True),
    ("train.run.setup", "train.gpt", True),  # up
    ("train.store.checkpoint", "train.run.config", True),
    ("train.cli", "train.store.rundir", True),
    ("train.grpo.loop", "train.grpo.config", False),  # within a command's package
    ("train.gpt", "train.run.setup", False),  # down
    ("train.run.peers", "train.store.rundir", False),
])
def test_the_rules_refuse_what_runs_up_or_across(importer, target, refused):
  assert (_refusal(importer, target) is not None) == refused
