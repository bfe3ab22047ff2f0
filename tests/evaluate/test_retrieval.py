"""Passkey retrieval at multiples of a short window: per-length accuracy with its Wilson interval against
chance, on a stand-in scorer that retrieves only within two windows and on a real tiny model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from ropelab.config import ConfigError, build_run_config
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.evaluate import retrieval
from ropelab.evaluate.retrieval import RetrievalSettings, accuracy_at, length_result, passkey_retrieval
from ropelab.evaluate.ruler_score import wilson_interval
from ropelab.model import Transformer

BYTES = ByteTokenizer()
SHORT = 128


def tiny_model(max_seq_len: int = 8 * SHORT + 16) -> Transformer:
    config = build_run_config(overrides=["model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2",
                                         "model.d_ff=64", f"model.max_seq_len={max_seq_len}"])
    config.model.vocab_size = 260
    torch.manual_seed(0)
    return Transformer(config.model).eval()


@given(st.integers(1, 200), st.data())
def test_above_chance_means_the_interval_clears_chance(n, data):
    correct = data.draw(st.integers(0, n))
    scored = [{"top1": i < correct, "rank": 1.0 if i < correct else 3.0} for i in range(n)]
    result = length_result(2, 256, scored, chance=0.1)
    assert result["accuracy"] == correct / n and result["interval"] == list(wilson_interval(correct / n, n))
    assert result["interval"][0] - 1e-12 <= result["accuracy"] <= result["interval"][1] + 1e-12
    assert result["above_chance"] == (result["interval"][0] > 0.1)


def test_a_model_that_retrieves_within_two_windows(monkeypatch):
    def within_two_windows(model, items, decode, pad_id, batch_size, device):
        return [{"top1": item.length <= 2 * SHORT, "rank": 1.0 if item.length <= 2 * SHORT else 5.0} for item in items]

    monkeypatch.setattr(retrieval, "score_items", within_two_windows)
    settings = RetrievalSettings(SHORT, items=10, depths=(0.0, 0.5))
    result = passkey_retrieval(tiny_model(), BYTES, settings)
    assert result["chance"] == 0.1 and [r["length"] for r in result["lengths"]] == [128, 256, 512, 1024]
    assert [r["n"] for r in result["lengths"]] == [20] * 4
    assert [r["above_chance"] for r in result["lengths"]] == [True, True, False, False]
    far = accuracy_at(result, (4, 8))
    assert far["n"] == 40 and far["accuracy"] == 0.0 and not far["above_chance"]
    near = accuracy_at(result, (1, 2))
    assert near["accuracy"] == 1.0 and near["above_chance"] and accuracy_at(result, (16,)) is None


def test_a_real_tiny_model_is_scored_with_stable_items():
    settings = RetrievalSettings(SHORT, multiples=(1, 2), items=2, distractors=4)
    first = passkey_retrieval(tiny_model(), BYTES, settings)
    again = passkey_retrieval(tiny_model(), BYTES, settings)
    assert first == again and first["chance"] == 0.2
    for row in first["lengths"]:
        assert row["n"] == 4 and 0 <= row["accuracy"] <= 1 and 0.2 <= row["mrr"] <= 1


def test_mistakes_are_one_line():
    with pytest.raises(ConfigError, match=r"cannot hold the passkey needle"):
        passkey_retrieval(tiny_model(), BYTES, RetrievalSettings(64, multiples=(1,)))
    with pytest.raises(ConfigError, match=r"beyond the model's max_seq_len 512"):
        passkey_retrieval(tiny_model(512), BYTES, RetrievalSettings(SHORT))
    with pytest.raises(ConfigError, match=r"multiples"):
        RetrievalSettings(SHORT, multiples=()).validate()


@pytest.mark.parametrize("alphabet, allowed", [("letters", set("abcdefghijklmnopqrstuvwxyz")), ("digits", set("0123456789"))])
def test_keys_are_made_of_the_alphabet_asked_for(alphabet, allowed):
    from ropelab.evaluate.longctx_items import build_items, haystack_source

    settings = RetrievalSettings(SHORT, multiples=(1, 2), items=3, alphabet=alphabet)
    items = build_items(BYTES, "passkey", haystack_source(BYTES, "passkey", None, 2 * SHORT), settings.longctx_settings())
    for item in items:
        keys = [BYTES.decode(c).strip() for c in item.candidates]
        assert keys[0] == item.answer and len(set(keys)) == 10
        assert all(len(k) == 5 and set(k) <= allowed for k in keys)
        assert BYTES.decode(item.prompt.tolist()).count(item.answer) == 2  # the needle names it twice
    if alphabet == "digits":
        assert all(item.answer[0] != "0" for item in items)


def test_an_alphabet_too_small_for_the_distractors_is_one_line():
    from ropelab.evaluate.longctx_items import make_settings

    with pytest.raises(ConfigError, match=r"^distractors=26: must be >= 1 and fewer than the 26 answers of 1 letters"):
        make_settings(answer_alphabet="letters", digits=1, distractors=26)
    with pytest.raises(ConfigError, match=r"^answer_alphabet='greek': choose one of digits, letters"):
        make_settings(answer_alphabet="greek")
