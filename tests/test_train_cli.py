"""train/cli.py: how a command ends on bad input and on a Ctrl-C before it has written anything."""

import importlib

import pytest

from train import cli


def _raise(error):
  raise error


def test_bad_input_while_starting_is_one_line_and_exit_2(capsys):
  assert cli.run(lambda: _raise(cli.UsageError("--steps must be positive"))) == cli.EXIT_USAGE
  assert capsys.readouterr().err == "error: --steps must be positive\n"


def test_bad_input_after_starting_keeps_its_traceback():
  with pytest.raises(ValueError, match="a bug"):
    cli.run(lambda: None, lambda _: _raise(ValueError("a bug")))


def test_ctrl_c_while_starting_is_one_line_and_exit_130_when_the_command_says_what_it_left(capsys):
  assert cli.run(lambda: _raise(KeyboardInterrupt()), interrupted="nothing was saved") == 130
  assert capsys.readouterr().err == "error: nothing was saved\n"
  with pytest.raises(KeyboardInterrupt):  # a command that did not say: Python's own report
    cli.run(lambda: _raise(KeyboardInterrupt()))


@pytest.mark.parametrize("command,starts_with", [("train.gpt", "config_lib.command"), ("train.grpo.__main__", "configure")])
def test_training_commands_interrupted_in_set_up(monkeypatch, capsys, tmp_path, command, starts_with):
  module = importlib.import_module(command)
  owner, _, name = starts_with.rpartition(".")
  monkeypatch.setattr(getattr(module, owner) if owner else module, name, lambda argv: _raise(KeyboardInterrupt()))
  assert module.main(["--run-dir", str(tmp_path / "run")]) == 130
  assert capsys.readouterr().err == "error: interrupted before training started; nothing was saved\n"
  assert not (tmp_path / "run").exists()
