"""The pages hold: every command README.md and docs/*.md show takes the flags it is shown
with (each command's own ``--help``), and the quick start runs as the README writes it and
prints what the pages claim of it: the first logged loss (6.6), one validation loss in the
trainer's log and in ``train.eval``'s line, ``--print-config`` read back to itself, a
finished run's ``--resume`` and the default model's export refused in one line that names
the way on.

The run is the README's ``python -m train.gpt`` cut to 2 steps on one device with 2,048
validation targets (about 25 s here, most of it the compile); the flags' check needs no
JAX and takes about a second.
"""
import contextlib
import importlib
import io
import json
import pathlib
import re
import shlex

import pytest

from train import eval as eval_lib
from train import export as export_lib
from train import gpt

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


def _run(main, argv: list[str], capsys) -> tuple[int, str, str]:
  code = main(argv)
  out, err = capsys.readouterr()
  return code, out, err


def test_the_quick_start_prints_what_the_pages_say(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)  # the commands' default run directory is runs/ where they run
  code, out, err = _run(gpt.main, ["--steps", "2", "--mesh", "fs=1", "--eval-tokens", "2048"], capsys)
  assert code == 0, err
  lines = out.splitlines()
  iterations = [line for line in lines if line.startswith("iteration")]
  # README: "the logged lm loss falls from 6.6 (step 1, the first line)"; training.md: the legend
  assert iterations[0].startswith("iteration        1/       2 |") and len(iterations) == 2
  assert round(float(re.search(r"lm loss: (\S+)", iterations[0]).group(1)), 1) == 6.6
  assert any(line.startswith("each line: lm loss = the mean over the interval's applied steps") for line in lines)
  validation = [line for line in lines if line.startswith("validation at iteration")][-1]
  trainer = validation.split(" | ", 1)[1]
  assert trainer.endswith("| targets: 2048")

  # training.md, huggingface.md: train.eval RUN_DIR repeats the run's validation loss and count
  code, out, err = _run(eval_lib.main, ["runs/tiny-dion"], capsys)
  assert code == 0, err
  evaluated = out.strip().splitlines()[-1]
  assert evaluated.startswith("validation lm loss: ") and "| targets: 2048 |" in evaluated
  # two compiled programs (the trainer's step and eval's): the same 7 digits, within 1e-6
  assert float(evaluated.split()[3]) == pytest.approx(float(trainer.split()[3]), rel=1e-6)

  # README: "python -m train.gpt --resume" continues after a stop; a finished run says how to go on
  code, _, err = _run(gpt.main, ["--resume", "--steps", "2"], capsys)
  assert code == 2 and err.count("\n") == 1 and "--steps 4 --lr-decay-steps 4" in err, err
  code, _, err = _run(gpt.main, ["--resume", "--steps", "3"], capsys)
  assert code == 2 and "pass --lr-decay-steps 3" in err and err.count("\n") == 1, err

  # training.md: --print-config writes the resolved flags, which --config reads back to themselves
  code, printed, _ = _run(gpt.main, ["--preset", "small", "--print-config"], capsys)
  (tmp_path / "small.yaml").write_text(printed)
  assert "seq_len: 1024\n" in printed and "lr: 0.02\n" in printed
  assert _run(gpt.main, ["--config", "small.yaml", "--print-config"], capsys)[1] == printed

  # huggingface.md: the default model does not export, and the line names the flags that would
  code, _, err = _run(export_lib.main, ["runs/tiny-dion", "--output", "exported"], capsys)
  assert code == 2 and err.count("\n") == 1 and "--mlp swiglu --qk-norm none" in err, err
  assert not (tmp_path / "exported").exists()
  assert json.loads((tmp_path / "runs" / "tiny-dion" / "config.json").read_text())["train"]["steps"] == 2
