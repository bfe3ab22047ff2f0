"""The byte tokenizer as a `tokenizers.Tokenizer` (`ByteTokenizer.to_tokenizers`): the same ids for every
text, the same special ids, the same decoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from ropelab.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer, HFTokenizer  # noqa: E402

BYTES = ByteTokenizer()
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "café, naïve, é",
    "日本語のテキスト",
    "emoji 🙂👍🏽 and a flag 🇫🇷",
    " leading space,  two spaces, tab\t, CRLF\r\n, trailing  \n\n",
    "",
    "\x00\x7f control",
]


@pytest.fixture(scope="module")
def rust():
    return BYTES.to_tokenizers()


@pytest.mark.parametrize("text", TEXTS)
def test_every_utf8_byte_is_its_own_id(rust, text):
    ids = rust.encode(text).ids
    assert ids == list(text.encode("utf-8")) == BYTES.encode_batch([text])[0]
    assert rust.decode(ids) == text == BYTES.decode(ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_any_text_encodes_to_its_bytes(rust, text):
    ids = rust.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert rust.decode(ids) == text


def test_ids_are_the_bytes_in_order():
    """Each id's token is the byte-level character standing for that byte (GPT-2's table)."""
    bytes_to_unicode = pytest.importorskip("transformers.convert_slow_tokenizer").bytes_to_unicode
    rust = BYTES.to_tokenizers()
    table = bytes_to_unicode()
    assert [rust.id_to_token(b) for b in range(256)] == [table[b] for b in range(256)]


def test_special_tokens_have_the_byte_tokenizers_ids(rust):
    assert rust.get_vocab_size() == BYTES.vocab_size == 259
    assert [rust.token_to_id(t) for t in SPECIAL_TOKENS] == [BYTES.eos_id, BYTES.bos_id, BYTES.pad_id]
    wrapped = HFTokenizer(rust, "bytes")
    assert (wrapped.vocab_size, wrapped.eos_id, wrapped.bos_id, wrapped.pad_id) == (259, 256, 257, 258)
    assert wrapped.encode_batch(TEXTS) == BYTES.encode_batch(TEXTS)


def test_special_tokens_in_text_stay_bytes_and_decoding_drops_them(rust):
    text = "a<|endoftext|>b<|pad|>"
    assert rust.encode(text).ids == list(text.encode("utf-8"))
    ids = [104, BYTES.eos_id, 105, BYTES.pad_id, BYTES.bos_id]
    assert rust.decode(ids) == BYTES.decode(ids) == "hi"


def test_invalid_utf8_decodes_like_the_byte_tokenizer(rust):
    for ids in ([0xFF], [0xC3], [0x61, 0xE6, 0x97, 0x62], [0xF0, 0x9F, 0x99], [0xC0, 0xAF, 0xF5, 0x80]):
        assert rust.decode(ids) == BYTES.decode(ids), ids
