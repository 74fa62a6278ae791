"""train/cli.py: how a command ends on bad input and on a Ctrl-C before it has written anything."""

import importlib

import pytest

from train import cli


def _raise(error):
  raise error


def _not_escaping(call):
  """``call()``, a KeyboardInterrupt escaping it a failure (not pytest's own stop)."""
  try:
    return call()
  except KeyboardInterrupt:
    pytest.fail("the Ctrl-C escaped the command as a traceback")


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


def test_ctrl_c_while_a_read_only_command_works_is_one_line_and_exit_130(capsys, monkeypatch):
  monkeypatch.setattr(cli, "_caught_interrupt", False)
  assert _not_escaping(lambda: cli.run(lambda: 1, lambda _: _raise(KeyboardInterrupt()), interrupted="nothing written",
                                       read_only=True)) == 130
  assert capsys.readouterr().err == "error: nothing written\n"
  assert cli._caught_interrupt  # cli.exit then ends the process without the teardown that crashed (exit 139)
  with pytest.raises(KeyboardInterrupt):  # a command that writes while it works: its own report
    cli.run(lambda: 1, lambda _: _raise(KeyboardInterrupt()), interrupted="nothing saved")


@pytest.mark.parametrize("command,start,then", [("train.eval", "_start", "_report"),
                                                ("train.sample", "_restore", "_write")])
def test_evaluation_and_sampling_interrupted_while_they_work(monkeypatch, capsys, command, start, then):
  """A Ctrl-C in the evaluation or the generation: was a traceback (and exit 139)."""
  module = importlib.import_module(command)
  monkeypatch.setattr(cli, "_caught_interrupt", False)
  monkeypatch.setattr(module, start, lambda argv: (None, None, None))
  monkeypatch.setattr(module, then, lambda *args: _raise(KeyboardInterrupt()))
  assert _not_escaping(lambda: module.main(["run"])) == 130
  assert capsys.readouterr().err == f"error: interrupted; {command} writes no files\n"
