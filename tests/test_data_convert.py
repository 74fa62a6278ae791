import os
import subprocess
import sys

import numpy as np
import pytest

from data import convert, fineweb, megatron, tokenizer


def _files(directory):
  return sorted(os.listdir(directory))


def test_fineweb_to_megatron_cuts_sequences_across_shards(tmp_path, capsys):
  fineweb.write_shard(str(tmp_path / "fw_000000.bin"), np.arange(7))
  fineweb.write_shard(str(tmp_path / "fw_000001.bin"), np.arange(100, 109))
  out = tmp_path / "out"
  rc = convert.main(["fineweb-to-megatron", "--input", str(tmp_path / "fw_*.bin"),
                     "--output-prefix", str(out / "ds"), "--sequence-length", "4", "--quiet"])
  assert rc == 0
  stream = list(range(7)) + list(range(100, 109))
  ds = megatron.IndexedDataset(str(out / "ds"))
  assert ds.dtype == np.uint16 and len(ds) == 3
  assert [ds[i].tolist() for i in range(3)] == [stream[0:5], stream[5:10], stream[10:15]]
  assert ds.document_indices.tolist() == [0, 1, 2, 3]
  assert _files(out) == ["ds.bin", "ds.idx"]
  summary = capsys.readouterr().out
  written = 15 * 2 + (34 + 3 * (4 + 8) + 4 * 8)  # uint16 tokens + MMIDIDX index
  assert f"2 input files -> 3 documents, 15 tokens, {written:,} bytes written" in summary
  assert "1 trailing tokens dropped" in summary


def test_tokenize_text_and_jsonl_to_megatron(tmp_path, capsys):
  (tmp_path / "a.txt").write_bytes("héllo\n".encode())
  (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "", "id": 2}\n'
                                    '{"body": "x", "text": "two"}\n')
  rc = convert.main(["tokenize", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                     "--output-prefix", str(tmp_path / "out" / "m"), "--quiet"])
  assert rc == 0
  ds = megatron.IndexedDataset(str(tmp_path / "out" / "m"))
  docs = [ds[i].tolist() for i in range(len(ds))]
  assert docs == [[104, 195, 169, 108, 108, 111, 10, 256], [111, 110, 101, 256],
                  [116, 119, 111, 256]]
  assert "2 input files -> 3 documents, 16 tokens" in capsys.readouterr().out


def test_tokenize_to_fineweb_shards(tmp_path):
  texts = [f"document number {i}\n" * (i + 1) for i in range(5)]
  paths = []
  for i, t in enumerate(texts):
    paths.append(str(tmp_path / f"{i}.txt"))
    open(paths[-1], "w").write(t)
  summary = convert.tokenize(paths, str(tmp_path / "out" / "fw"), output_format="fineweb",
                             shard_tokens=100, progress=False)
  expected = np.concatenate([tokenizer.encode(t, append_eod=True) for t in texts])
  shards = fineweb.shard_paths(str(tmp_path / "out" / "fw_*.bin"))
  assert summary["outputs"] == shards and summary["tokens"] == len(expected)
  sizes = [fineweb.read_header(p) for p in shards]
  assert sizes[:-1] == [100] * (len(shards) - 1) and 0 < sizes[-1] <= 100
  np.testing.assert_array_equal(np.concatenate([fineweb.read_shard(p) for p in shards]),
                                expected)


def _run_failing(argv, capsys):
  rc = convert.main(argv)
  err = capsys.readouterr().err
  assert rc == 2
  lines = [line for line in err.splitlines() if line]
  assert len(lines) == 1 and lines[0].startswith("error: ")
  return lines[0]


def test_bad_shard_midway_leaves_no_output(tmp_path, capsys):
  fineweb.write_shard(str(tmp_path / "fw_000000.bin"), np.arange(50))
  fineweb.write_shard(str(tmp_path / "fw_000001.bin"), np.arange(50))
  with open(tmp_path / "fw_000001.bin", "ab") as f:
    f.write(b"\x00\x00")  # one token more than the header says
  out = tmp_path / "out"
  line = _run_failing(["fineweb-to-megatron", "--input", str(tmp_path / "fw_*.bin"),
                       "--output-prefix", str(out / "ds"), "--sequence-length", "4",
                       "--quiet"], capsys)
  assert line == (f"error: {tmp_path}/fw_000001.bin: header says 50 tokens (1124 bytes) but "
                  "the file has 1126 bytes")
  assert not out.exists() or _files(out) == []


def test_bad_jsonl_line_leaves_no_output(tmp_path, capsys):
  (tmp_path / "good.txt").write_text("fine\n")
  (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
  (tmp_path / "out").mkdir()
  line = _run_failing(["tokenize", str(tmp_path / "good.txt"), str(tmp_path / "b.jsonl"),
                       "--format", "fineweb", "--output-prefix", str(tmp_path / "out" / "x"),
                       "--quiet"], capsys)
  assert line == f"error: {tmp_path}/b.jsonl:2: field 'text' is not a string"
  assert _files(tmp_path / "out") == []
  (tmp_path / "c.jsonl").write_text('{"text": "ok"}\nnot json\n')
  line = _run_failing(["tokenize", str(tmp_path / "c.jsonl"), "--output-prefix",
                       str(tmp_path / "out" / "x"), "--quiet"], capsys)
  assert line == (f"error: {tmp_path}/c.jsonl:2: no JSON object with a 'text' field "
                  "(JSONDecodeError)")
  assert _files(tmp_path / "out") == []


@pytest.mark.parametrize("case", ["missing", "empty", "magic", "short", "under_a_file", "a_folder",
                                  "shard_tokens", "sequence_length"])
def test_bad_inputs_give_one_line_errors(tmp_path, capsys, case):
  out = str(tmp_path / "out" / "x")
  (tmp_path / "a.txt").write_text("abc")
  if case == "under_a_file":  # was "[Errno 17] File exists: 'a.txt'", exit 1
    argv = ["tokenize", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "a.txt" / "x")]
    expected = f"error: --output-prefix {tmp_path}/a.txt/x: {tmp_path}/a.txt is a file, not a folder"
  elif case == "a_folder":  # wrote out/.bin and out/.idx
    argv = ["tokenize", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "out") + "/"]
    expected = (f"error: --output-prefix {tmp_path}/out/: names a folder, not the files' name; add one,"
                f" e.g. {tmp_path}/out/mydata")
  elif case == "shard_tokens":  # named the conversion's temporary folder
    argv = ["tokenize", str(tmp_path / "a.txt"), "--output-prefix", out, "--format", "fineweb",
            "--shard-tokens", "0"]
    expected = "error: --shard-tokens must be positive, got 0"
  elif case == "sequence_length":
    argv = ["fineweb-to-megatron", "--input", str(tmp_path / "*.bin"), "--output-prefix", out,
            "--sequence-length", "0"]
    expected = "error: --sequence-length must be positive, got 0"
  elif case == "missing":
    argv = ["tokenize", str(tmp_path / "nope.txt"), "--output-prefix", out]
    expected = f"error: {tmp_path}/nope.txt: no such input file"
  elif case == "empty":
    (tmp_path / "e.txt").write_text("")
    argv = ["tokenize", str(tmp_path / "e.txt"), "--output-prefix", out]
    expected = f"error: {tmp_path}/e.txt: no non-empty documents in 1 input file"
  elif case == "magic":
    (tmp_path / "m.bin").write_bytes(b"\x00" * 2048)
    argv = ["fineweb-to-megatron", "--input", str(tmp_path / "m.bin"), "--output-prefix", out]
    expected = f"error: {tmp_path}/m.bin: wrong magic 0 (a FineWeb shard starts with 20240520)"
  else:
    fineweb.write_shard(str(tmp_path / "s.bin"), np.arange(10))
    argv = ["fineweb-to-megatron", "--input", str(tmp_path / "s.bin"), "--output-prefix", out,
            "--sequence-length", "10"]
    expected = f"error: {tmp_path}/s.bin: 10 tokens make no sequence of 11"
  assert _run_failing(argv + ["--quiet"], capsys) == expected
  assert not os.path.exists(tmp_path / "out") or _files(tmp_path / "out") == []


@pytest.mark.parametrize("argv, expected", [
    ([], "error: the following arguments are required: command (see python -m data.convert --help)"),
    (["tokenize", "a.txt", "--output-prefix", "x", "--shard-tokens", "many"],
     "error: argument --shard-tokens: invalid int value: 'many' (see python -m data.convert tokenize --help)"),
])
def test_bad_flags_give_one_line_errors(capsys, argv, expected):
  """Was argparse's usage line above the error."""
  with pytest.raises(SystemExit) as stop:
    convert.main(argv)
  assert stop.value.code == 2 and capsys.readouterr().err == expected + "\n"


def test_a_ctrl_c_is_one_line_exit_130_nothing_written(tmp_path, capsys, monkeypatch):
  (tmp_path / "a.txt").write_text("abc")
  (tmp_path / "out").mkdir()

  def interrupted(path, json_key):
    yield b"abc", 3
    raise KeyboardInterrupt

  monkeypatch.setattr(convert, "read_documents", interrupted)
  prefix = str(tmp_path / "out" / "x")
  try:
    assert convert.main(["tokenize", str(tmp_path / "a.txt"), "--output-prefix", prefix, "--quiet"]) == 130
  except KeyboardInterrupt:
    pytest.fail("the Ctrl-C escaped the command as a traceback")
  assert capsys.readouterr().err == f"error: interrupted; nothing was written to {prefix}*\n"
  assert _files(tmp_path / "out") == []


def test_command_line_exit_status_help_and_progress(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  help_run = subprocess.run([sys.executable, "-m", "data.convert", "--help"], env=env,
                            capture_output=True, text=True)
  assert help_run.returncode == 0
  assert "fineweb-to-megatron" in help_run.stdout and "tokenize" in help_run.stdout
  (tmp_path / "a.txt").write_text("abc")
  ok = subprocess.run([sys.executable, "-m", "data.convert", "tokenize", str(tmp_path / "a.txt"),
                       "--output-prefix", str(tmp_path / "m")], env=env, capture_output=True,
                      text=True)
  assert ok.returncode == 0 and "tokenizing: [####" in ok.stderr
  written = 4 * 2 + (34 + 1 * (4 + 8) + 2 * 8)
  assert f"1 input file -> 1 document, 4 tokens, {written:,} bytes written" in ok.stdout
  bad = subprocess.run([sys.executable, "-m", "data.convert", "tokenize", str(tmp_path / "z"),
                        "--output-prefix", str(tmp_path / "m")], env=env, capture_output=True,
                       text=True)
  assert bad.returncode == 2 and bad.stderr == f"error: {tmp_path}/z: no such input file\n"


def test_tokenize_with_a_hugging_face_tokenizer(tmp_path):
  from tests.test_data_sft import make_tokenizer

  make_tokenizer(tmp_path, ["hello", "world"])
  (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "world other"}\n')
  summary = convert.tokenize([str(tmp_path / "a.jsonl")], str(tmp_path / "out" / "d"), progress=False,
                             tokenizer_dir=str(tmp_path))
  assert summary["documents"] == 2 and summary["tokens"] == 6
  ds = megatron.IndexedDataset(str(tmp_path / "out" / "d"))
  assert list(ds.tokens) == [2, 3, 1, 3, 0, 1]
