import numpy as np
import pytest

from data import tokenizer


def test_encode_is_utf8_bytes_plus_optional_eod():
  np.testing.assert_array_equal(tokenizer.encode("aé"), [97, 195, 169])
  np.testing.assert_array_equal(tokenizer.encode(b"\x00\xff", append_eod=True), [0, 255, 256])
  assert tokenizer.encode("x").dtype == np.uint16
  assert tokenizer.encode("").shape == (0,)


def test_decode_inverts_encode_and_marks_special_ids():
  text = "déjà vu\n"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  assert tokenizer.decode([104, 105, 256, 300, 33]) == "hi<|endoftext|>\ufffd!"


@pytest.mark.parametrize("vocab,multiple,tp,expected", [
    (257, 128, 1, 384), (257, 128, 4, 512), (256, 128, 1, 256), (50257, 128, 1, 50304),
    (50257, 64, 8, 50688)])
def test_padded_vocab_size(vocab, multiple, tp, expected):
  assert tokenizer.padded_vocab_size(vocab, multiple_of=multiple, tp=tp) == expected


def test_default_padding_is_a_multiple_of_128_covering_the_vocab():
  assert tokenizer.VOCAB_SIZE == tokenizer.EOD + 1 == 257
  assert tokenizer.padded_vocab_size() == 384
