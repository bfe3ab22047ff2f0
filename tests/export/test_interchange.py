"""Export to / import from native Hugging Face folders: same logits (fp32, within what rounding explains:
tests/helpers.py's parity_tolerance), refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from ropelab.cli import main  # noqa: E402
from ropelab.config import ConfigError, build_run_config  # noqa: E402
from ropelab.data.tokenizer import load_tokenizer  # noqa: E402
from ropelab.export.hf import export_hf  # noqa: E402
from ropelab.sources import import_model as import_hf, load  # noqa: E402
from ropelab.sources.imported import save_weights_only  # noqa: E402
from ropelab.model import Transformer  # noqa: E402
from tests.helpers import assert_logits_match  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    return out, export_hf(run, out)


def _fake_run(run_dir, overrides, seed=0):
    """A run folder (config.yaml + one complete checkpoint) without training: for refusals and bytes."""
    config = build_run_config(overrides=[
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.vocab_size=320",
        "data.tokenizer=bytes", "data.seq_len=16", *overrides,
    ])
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    torch.manual_seed(seed)
    save_weights_only(run_dir, 5, Transformer(config.model), config)
    return run_dir


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)
    return model.eval()


def _ids(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(seed))


def _assert_same_logits(ours: Transformer, theirs, idx: torch.Tensor) -> None:
    """ropelab forms RoPE angles in float64, transformers in float32."""
    with torch.no_grad():
        a, b = ours(idx)[0], theirs(input_ids=idx).logits
    assert_logits_match(a, b, ours.config, angles_differ=True)


# ------------------------------------------------------------------ export


def test_export_loads_natively_with_same_logits(run, exported):
    out, info = exported
    assert info["architecture"] == "LlamaForCausalLM" and info["route"] == "native" and info["step"] == 3
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(info["files"])
    assert not list(out.glob("*.py")) and "auto_map" not in json.loads((out / "config.json").read_text())

    ours, _, config = load(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.dtype == torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0].tolist() == load_tokenizer("bpe:300").encode_batch([TEXT])[0]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id == theirs.config.pad_token_id
    _assert_same_logits(ours, theirs, ids)
    _assert_same_logits(ours, theirs, _ids(config.model.vocab_size))

    generated = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert ids.shape[1] < generated.shape[1] <= ids.shape[1] + 5
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_export_checkpoint_folder_and_never_overwrites(run, exported, tmp_path):
    checkpoint = run / "checkpoints" / "step_00000003"
    model, _, _ = load(checkpoint)
    assert torch.equal(model.embed.weight, load(run).model.embed.weight)
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(checkpoint, exported[0])
    (tmp_path / "file.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(run, tmp_path)
    assert (tmp_path / "file.txt").read_text() == "keep me"


def test_export_byte_tokenizer_run_ships_an_equivalent_tokenizer(tmp_path):
    run_dir = _fake_run(tmp_path / "bytes-run", [])
    info = export_hf(run_dir, tmp_path / "hf")
    assert info["tokenizer"] == "saved (bytes, 259 tokens)" and "tokenizer.json" in info["files"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert theirs.generation_config.eos_token_id == 256
    source = load(run_dir)
    _assert_same_logits(source.model, theirs, _ids(320))

    ours = source.tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    # no BOS named (lm-eval would prefix texts with it; ropelab prefixes EOS), the trained context as n_positions
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (ours.eos_id, None, ours.pad_id)
    assert (theirs.config.eos_token_id, theirs.config.bos_token_id, theirs.config.pad_token_id) == (256, None, 258)
    assert (theirs.config.n_positions, theirs.config.max_position_embeddings) == (16, source.config.model.max_seq_len)
    mixed = TEXT + "café 日本 🙂\t\r\n  <|endoftext|> end"  # a special token written in text stays bytes
    ids = tokenizer(mixed).input_ids
    assert ids == ours.encode_batch([mixed])[0] == list(mixed.encode("utf-8"))
    assert tokenizer.decode(ids) == mixed and tokenizer.decode([104, 256, 105], skip_special_tokens=True) == "hi"


def test_export_tokenizer_adds_no_special_tokens_as_ropelab_encodes(tmp_path):
    from tokenizers import processors

    rust = load_tokenizer("bytes").to_tokenizers()
    rust.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 257)])
    rust.save(str(tmp_path / "tokenizer.json"))
    run_dir = _fake_run(tmp_path / "run", [f"data.tokenizer={tmp_path / 'tokenizer.json'}"])
    ours = load(run_dir).tokenizer
    export_hf(run_dir, tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert rust.encode(TEXT).ids[0] == 257
    assert theirs(TEXT).input_ids == theirs.encode(TEXT) == ours.encode_batch([TEXT])[0] == list(TEXT.encode())


@pytest.mark.parametrize(
    "override, reason",
    [("model.rope.layout=interleaved", "layout=interleaved"), ("model.rope.fraction=0", "rotates every channel")],
    ids=["interleaved", "nope"],
)
def test_export_without_native_class_ships_remote_code(tmp_path, override, reason):
    run_dir = _fake_run(tmp_path / "run", [override])
    info = export_hf(run_dir, tmp_path / "hf")  # see test_remote_code.py for the loading and the logits
    assert info["route"] == "remote_code" and reason in info["why"] and "modeling_ropelab.py" in info["files"]
    assert not list(tmp_path.glob(".tmp_*"))


@pytest.mark.parametrize("make", ["missing", "empty", "hf-folder", "incomplete"])
def test_load_model_rejects_other_paths(tmp_path, make):
    path = tmp_path / make
    if make != "missing":
        path.mkdir()
    if make == "hf-folder":
        (path / "config.json").write_text("{}")
    if make == "incomplete":
        _fake_run(tmp_path / "run", [])
        path = tmp_path / "run" / "checkpoints" / "step_00000005"
        (path / "COMPLETE").unlink()
    with pytest.raises(ConfigError):
        load(path)


# ------------------------------------------------------------------ import

HF_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=128)
HF_CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_act="gelu", use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25})),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_import_local_hf_model(tmp_path, case):
    model_class, config_class, kwargs = HF_CASES[case]
    torch.manual_seed(0)
    theirs = _randomize(getattr(transformers, model_class)(getattr(transformers, config_class)(**HF_COMMON, **kwargs)))
    theirs.save_pretrained(tmp_path / "hf")
    info = import_hf(str(tmp_path / "hf"), tmp_path / "imported")
    assert info["architecture"] == model_class and "bytes" in info["tokenizer"]
    assert (tmp_path / "imported" / "checkpoints" / "step_00000000" / "COMPLETE").is_file()
    ours, _, config = load(tmp_path / "imported")
    assert config.data.tokenizer == "bytes" and config.model.vocab_size == 96
    _assert_same_logits(ours, theirs, _ids(96))


def test_export_import_round_trip_keeps_tokenizer(run, exported, tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(exported[0], source)
    info = import_hf(str(source), tmp_path / "back")
    assert info["tokenizer"] == f"saved from {source.resolve()} (300 tokens)"
    assert yaml.safe_load((tmp_path / "back" / "config.yaml").read_text())["data"]["tokenizer"] == "tokenizer.json"
    expected = load_tokenizer(str(source))
    shutil.rmtree(source)  # the imported folder holds its own tokenizer: it works without its source, and moved
    (tmp_path / "moved").mkdir()
    shutil.move(tmp_path / "back", tmp_path / "moved" / "back")
    ours, tokenizer, config = load(tmp_path / "moved" / "back")
    assert config.data.tokenizer == str((tmp_path / "moved" / "back" / "tokenizer.json").resolve())
    assert tokenizer.fingerprint() == expected.fingerprint() and tokenizer.eos_id == expected.eos_id
    assert tokenizer.encode_batch([TEXT]) == expected.encode_batch([TEXT])
    original, _, _ = load(run)
    for (name, a), (_, b) in zip(original.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), name
    assert info["params"] == original.num_params()


def test_import_refusals(tmp_path, exported):
    with pytest.raises(ConfigError, match="no such file or directory"):
        import_hf(str(tmp_path / "missing"), tmp_path / "out")
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ConfigError, match="not a ropelab run directory .* a Hugging Face model folder or a .gguf file") as err:
        import_hf(str(tmp_path / "not-a-model"), tmp_path / "out")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not empty"):
        import_hf(str(exported[0]), exported[0])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ CLI


def test_cli_export_and_import(run, tmp_path, capsys):
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert "config.yaml" in capsys.readouterr().out and load(tmp_path / "back")
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 2  # never overwrites
    assert main(["import", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
