"""The pages hold: every command README.md and docs/*.md show takes the flags it is shown
with (each command's own ``--help``; about 2 s, no JAX), and every ``python -m benchmarks.NAME``
they show is a benchmark that adds those flags (read from its source).

What the pages claim of the commands' output is checked on runs the suite makes anyway:
the quick start's (``tests/test_train_gpt.py::test_default_command_trains``: the first
logged loss, the legend, one validation loss in the trainer's line and in ``train.eval``'s,
the refusals of a finished ``--resume`` and of the default model's export), a run of
fs=2,tp=2 evaluated on one device (``tests/test_train_sample.py``), ``--print-config``
read back to itself with its resolved defaults (``tests/test_train_run_config_file.py``),
a from-scratch Qwen3's export (``tests/test_train_store_hf.py``).
"""
import contextlib
import importlib
import io
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = {"train.gpt": "train.gpt", "train.eval": "train.eval", "train.sample": "train.sample",
            "train.export": "train.export", "train.plot": "train.plot", "train.grpo": "train.grpo.__main__",
            "train.plan": "train.plan.__main__", "train.gpu": "train.gpu.__main__", "data.convert": "data.convert"}


def documented_commands() -> list[tuple[str, str, list[str]]]:
  """``(page, command, argv)`` of every ``python -m train.X`` / ``data.X`` line of the pages'
  code blocks and inline code, its continuation lines joined and its comment dropped."""
  found = []
  for page in PAGES:
    text = page.read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S) + re.findall(r"`(python -m [^`]+)`", text)
    for block in blocks:
      for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        for part in line.split("&&"):
          match = re.search(r"python -m ((?:train|data)\.\w+)(.*)", part)
          if match:
            rest = match.group(2).split(" #")[0].split("|")[0].split(">")[0]
            try:
              argv = shlex.split(rest)
            except ValueError:  # an inline fragment with an unclosed quote
              continue
            found.append((page.name, match.group(1), argv))
  return found


def documented_benchmarks() -> list[tuple[str, str, list[str]]]:
  """``(page, benchmark, flags)`` of every ``python -m benchmarks.NAME`` the pages show, its
  flags up to the end of its code span or line; flags inside a quoted value (a benchmark's
  ``--common '--seq-len 128'``, also one the line breaks) are the trainer's and left out."""
  found = []
  for page in PAGES:
    text = re.sub(r"\\\n\s*", " ", page.read_text())
    for name, rest in re.findall(r"python -m benchmarks\.(\w+)([^`\n]*)", text):
      # A quoted value ends at its quote or, broken over lines in the page's text, the line's end.
      rest = re.sub(r"'[^']*(?:'|$)|\"[^\"]*(?:\"|$)", "", rest.split(" #")[0])
      found.append((page.name, name, re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)))
  return found


def benchmark_flags(name: str) -> set[str]:
  """The flags ``benchmarks/NAME.py`` adds, read from its source (importing a benchmark may set
  up JAX's devices); with the shared parsers of ``harness.py`` when it uses them; a benchmark
  that takes the trainer's flags takes ``train.gpt``'s."""
  source = (ROOT / "benchmarks" / f"{name}.py").read_text()
  if "harness.matrix_benchmark_parser" in source or "harness.add_out" in source:
    source += (ROOT / "benchmarks" / "harness.py").read_text()
  flags = set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", source))
  if "config_lib.parse(" in source or "gpt.main(" in source:
    flags |= set(re.findall(r"--[a-z][a-z0-9-]*", _help("train.gpt")))
  return flags | {"--help"}


def test_every_documented_benchmark_exists_with_its_flags():
  """A ``python -m benchmarks.NAME`` the pages show is a benchmark there, with those flags."""
  wrong = []
  benchmarks = documented_benchmarks()
  assert len(benchmarks) > 20
  for page, name, flags in benchmarks:
    if not (ROOT / "benchmarks" / f"{name}.py").exists():
      wrong.append(f"{page}: python -m benchmarks.{name}: no such benchmark")
      continue
    wrong += [f"{page}: python -m benchmarks.{name}: {f}" for f in flags if f not in benchmark_flags(name)]
  assert not wrong, "\n".join(wrong)


def _help(command: str, argv: tuple[str, ...] = ()) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
    importlib.import_module(COMMANDS[command]).main([*argv, "--help"])
  return out.getvalue()


def test_every_documented_flag_is_one_of_its_commands():
  """A flag the pages show is in the command's --help (``data.convert``: its subcommand's)."""
  flags, wrong = {}, []
  commands = documented_commands()
  assert len(commands) > 40 and {c for _, c, _ in commands} == set(COMMANDS)
  for page, command, argv in commands:
    sub = (argv[0],) if command == "data.convert" and argv and not argv[0].startswith("-") else ()
    if (command, sub) not in flags:
      flags[command, sub] = set(re.findall(r"--[a-z][a-z0-9-]*", _help(command, sub)))
    wrong += [f"{page}: python -m {command} {' '.join(argv)}: {a}" for a in argv
              if a.startswith("--") and a.split("=")[0] not in flags[command, sub]]
  assert not wrong, "\n".join(wrong)
