"""`data.tokenizer` naming a built-in model source: its GGUF file's tokenizer, read once into the cache
(the GGUF reader stubbed here: the byte tokenizer stands in for SmolLM2's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("tokenizers")

from ropelab.data.tokenizer import ByteTokenizer, HFTokenizer, builtin_model_tokenizer, load_tokenizer  # noqa: E402
from ropelab.sources import gguf, gguf_files  # noqa: E402


def test_a_builtin_name_loads_its_gguf_tokenizer_once(tmp_path, monkeypatch):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    reads = []

    def read(path):
        reads.append(path)
        return SimpleNamespace(backend_tokenizer=ByteTokenizer().to_tokenizers())

    monkeypatch.setenv("ROPELAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_files, "builtin_gguf", lambda name: file)
    monkeypatch.setattr(gguf, "load_gguf_tokenizer", read)
    first, second = load_tokenizer("smollm2-135m"), load_tokenizer("smollm2-135m")
    assert isinstance(first, HFTokenizer) and first.name == "smollm2-135m" and reads == [file]
    assert first.fingerprint() == second.fingerprint() and first.encode_batch(["ab"]) == [[97, 98]]
    assert list((tmp_path / "cache" / "tokenizers").glob("smollm2-135m-*.json"))
    assert builtin_model_tokenizer("bert-base-uncased") is None  # not built in: a hub name, as before
