"""Hugging Face export with ropelab's own modeling code (auto_map + trust_remote_code=True): configurations
without a native transformers class load through AutoModelForCausalLM with the same logits (fp32, within
what rounding explains: tests/helpers.py's parity_tolerance), and generate() works, with a key/value cache
giving the outputs of none."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from ropelab.config import LayerKind, ModelConfig, RopeConfig, build_run_config  # noqa: E402
from ropelab.export import remote_code  # noqa: E402
from ropelab.export.hf import export_hf, save_hf  # noqa: E402
from ropelab.sources import load  # noqa: E402
from ropelab.sources.imported import save_weights_only  # noqa: E402
from ropelab.model import Transformer  # noqa: E402
from tests.helpers import assert_logits_match  # noqa: E402

VOCAB = 97
GPT_NEOX_LIKE = dict(block="parallel", norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True)
CASES = {  # none has a native transformers class
    "nope": dict(rope=RopeConfig(fraction=0.0)),
    "rotary_dims_2": dict(rope=RopeConfig(rotary_dims=2), tie_embeddings=True),
    "fraction_0.25_sequential": dict(rope=RopeConfig(fraction=0.25, cache="none")),
    "interleaved": dict(rope=RopeConfig(fraction=1.0, layout="interleaved", theta=500.0)),
    "truncate": dict(rope=RopeConfig(fraction=0.5, style="truncate"), attn_bias=True),
    "parallel_qk_norm": dict(GPT_NEOX_LIKE, qk_norm=True, rope=RopeConfig(fraction=0.25)),
    "gqa_partial": dict(n_kv_head=2, rope=RopeConfig(fraction=0.5), qk_norm=True),
    "per_layer_nope": dict(rope=RopeConfig(fraction=1.0), rope_layers={1: {"fraction": 0.0}}, qk_norm=True),
}


def _model(seed: int = 0, **overrides) -> Transformer:
    config = ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=64, n_head=4, d_ff=128, max_seq_len=256, **overrides)
    model = Transformer(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights well away from the init (norms and biases too)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)
    return model.eval()


def _ids(seed: int = 1, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def _greedy(model: Transformer, idx: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        idx = torch.cat([idx, model(idx)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def _mask_to(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The prompt's attention mask extended with ones (generated tokens) to `length`."""
    return torch.cat([mask, torch.ones(mask.shape[0], length - mask.shape[1], dtype=mask.dtype)], dim=1)


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_remote_code_export_same_logits_and_generates(tmp_path, overrides):
    ours = _model(**overrides)
    info = save_hf(ours, tmp_path / "hf", token_ids={"eos_token_id": 5, "pad_token_id": 0, "bos_token_id": 400})
    assert info["route"] == "remote_code" and info["architecture"] == "RopelabForCausalLM" and info["why"]
    shipped = {"modeling_ropelab.py", "model.py", "rope_embedding.py", "attention.py", "config_model.py"}
    assert shipped | {"model.safetensors"} <= set(info["files"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["auto_map"] == remote_code.AUTO_MAP and config["model_type"] == "ropelab"
    assert config["eos_token_id"] == 5 and config.get("bos_token_id") is None  # 400 is outside the vocabulary

    theirs = _load(tmp_path / "hf")
    assert type(theirs).__name__ == "RopelabForCausalLM" and theirs.dtype == torch.float32
    as_json = lambda c: json.loads(json.dumps(dataclasses.asdict(c)))  # noqa: E731 - rope_layers keys: str
    assert as_json(theirs.model.config) == as_json(ours.config)  # the shipped ModelConfig, same settings
    idx = _ids()
    with torch.no_grad():
        assert_logits_match(theirs(input_ids=idx).logits, ours(idx)[0], ours.config)
        out = theirs.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=3, do_sample=False)
        assert out.shape == (2, idx.shape[1] + 3)
        assert torch.equal(out, _greedy(ours, idx, 3))


GENERATE_CASES = {  # (config, left padding of row 1)
    "fraction_0.25_sequential": (CASES["fraction_0.25_sequential"], 5),
    "gqa_partial": (CASES["gqa_partial"], 3),
    "plain": (CASES["interleaved"], 0),  # no padding: no document ids anywhere
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_cached_generate_equals_uncached(tmp_path, case):
    overrides, pad = GENERATE_CASES[case]
    save_hf(_model(**overrides), tmp_path / "hf")
    theirs = _load(tmp_path / "hf")
    assert theirs.generation_config.use_cache is not False  # None: generate() decides, and caches
    idx = _ids(4, length=12)
    mask = torch.ones_like(idx)
    mask[1, :pad] = 0
    lengths = []  # tokens fed to the ropelab Transformer by each forward
    theirs.model.register_forward_pre_hook(lambda _module, args: lengths.append(args[0].shape[1]))
    with torch.no_grad():
        cached = theirs.generate(idx, attention_mask=mask, max_new_tokens=32, do_sample=False)
        assert lengths == [12] + [1] * 31
        lengths.clear()
        uncached = theirs.generate(idx, attention_mask=mask, max_new_tokens=32, do_sample=False, use_cache=False)
        assert lengths == list(range(12, 44))
        assert cached.shape == (2, 44) and torch.equal(cached, uncached)

        # the cache by hand: prompt, then one token; the logits of the whole sequence in one forward
        prompt = theirs(input_ids=cached[:, :20], attention_mask=_mask_to(mask, 20), use_cache=True)
        step = theirs(input_ids=cached[:, 20:21], attention_mask=_mask_to(mask, 21), cache=prompt.cache)
        assert step.cache is prompt.cache and step.cache.get_seq_length() == 21
        full = theirs(input_ids=cached[:, :21], attention_mask=_mask_to(mask, 21)).logits
        assert_logits_match(step.logits[:, 0], full[:, 20], theirs.model.config)


WINDOWED = {  # a windowed layer, then a global one; partial RoPE: no native class, ropelab's code
    "chunked": {"L": LayerKind(attention="chunked", window=8), "G": LayerKind()},
    "sliding": {"L": LayerKind(attention="sliding", window=8), "G": LayerKind()},
}


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_left_padded_batch_generates_as_each_prompt_alone(tmp_path, kind):
    """As in transformers, a left-padded row's positions and chunks count from its first real token:
    prompts of 13, 6 and 9 tokens (5 and 3 windows of 8 cut mid-padding) and 12 tokens generated
    across window edges give each prompt's own tokens and logits."""
    ours = _model(rope=RopeConfig(fraction=0.5), layer_pattern="LG", layer_kinds=WINDOWED[kind])
    assert save_hf(ours, tmp_path / "hf")["route"] == "remote_code"
    theirs = _load(tmp_path / "hf")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (13, 6, 9)]
    ids, mask = torch.zeros(3, 13, dtype=torch.long), torch.zeros(3, 13, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, 13 - len(prompt):], mask[row, 13 - len(prompt):] = prompt, 1
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        batched = theirs.generate(ids, attention_mask=mask, **greedy)
        prompt_logits = theirs(input_ids=ids, attention_mask=mask).logits
        for row, prompt in enumerate(prompts):
            alone = theirs.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **greedy)
            assert batched.sequences[row, 13:].tolist() == alone.sequences[0, len(prompt):].tolist()
            step_logits = [torch.stack([step[i] for step in out.logits]) for out, i in ((batched, row), (alone, 0))]
            assert_logits_match(*step_logits, ours.config, keys=13 + 12)
            assert_logits_match(prompt_logits[row, 13 - len(prompt):], ours(prompt[None])[0][0], ours.config)


def test_static_cache_is_refused(tmp_path):
    """A StaticCache hands attention all its preallocated slots, filled or not: refused, not wrong logits."""
    save_hf(_model(**CASES["nope"]), tmp_path / "hf")
    theirs = _load(tmp_path / "hf")
    with torch.no_grad(), pytest.raises(ValueError, match="dynamic key/value caches only"):
        theirs.generate(_ids(), max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_tied_weights_padding_and_loss(tmp_path):
    ours = _model(tie_embeddings=True, rope=RopeConfig(fraction=0.5), rope_layers={0: {"layout": "interleaved"}})
    save_hf(ours, tmp_path / "hf")
    theirs = _load(tmp_path / "hf")
    assert theirs.model.lm_head.weight is theirs.model.embed.weight
    idx = _ids(2)
    with torch.no_grad():
        # left padding: each row's tokens see only themselves, at positions counted from their first token
        mask = torch.ones_like(idx)
        mask[1, :7] = 0
        padded = theirs(input_ids=idx, attention_mask=mask).logits
        assert_logits_match(padded[1, 7:], ours(idx[1:, 7:])[0][0], ours.config)
        assert_logits_match(padded[0], ours(idx[:1])[0][0], ours.config)
        # labels as in transformers: the loss of predicting token t+1 from tokens <= t
        out = theirs(input_ids=idx, labels=idx)
        assert_logits_match(out.logits, ours(idx)[0], ours.config)
        assert torch.equal(out.loss, F.cross_entropy(out.logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten()))


def test_native_configs_keep_their_class(tmp_path):
    info = save_hf(_model(), tmp_path / "hf")  # full RoPE, rmsnorm + swiglu: Llama
    assert info["route"] == "native" and info["architecture"] == "LlamaForCausalLM" and "why" not in info
    assert "modeling_ropelab.py" not in info["files"]
    assert "auto_map" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_shipped_code_is_the_installed_code():
    """One source of truth: the shipped modules are ropelab's own files, whole, written flat with their
    imports made relative (``from ropelab.rope.embedding import`` -> ``from .rope_embedding import``)."""
    files = remote_code.files_for_export()
    modules = remote_code.shipped_modules()
    assert set(files) == set(modules) | {"modeling_ropelab.py"}
    expected = {"model", "attention", "layers", "rope.embedding", "rope.kernels", "config.model", "config.rope"}
    assert expected <= set(modules.values())
    for name, module in modules.items():
        original = open(importlib.import_module(f"ropelab.{module}").__file__).read()
        relative = re.sub(r"^from ropelab\.([\w.]+) import", lambda m: f"from .{m.group(1).replace('.', '_')} import",
                          original, flags=re.M)
        assert files[name].split("\n", 1)[1] == relative, name  # after the generated banner
    for name, text in files.items():
        assert not re.search(r"^\s*(from|import)\s+ropelab\b", text, re.M), name
        compile(text, name, "exec")
    # the model's configuration only: no YAML, no run-level settings, no Triton kernel
    assert not [name for name, text in files.items() if re.search(r"^\s*(import|from) (yaml|triton)\b", text, re.M)]
    assert "class ModelConfig" in files["config_model.py"] and "def from_dict" in files["config_coerce.py"]
    assert not [name for name, text in files.items() if "class RunConfig" in text]


def test_a_package_import_is_refused(monkeypatch):
    """A shipped module imports each name from its defining module: a package's face cannot be shipped flat."""
    source = remote_code.MODELING_SOURCE.replace("from ropelab.config.model import ModelConfig",
                                                 "from ropelab.config import ModelConfig")
    monkeypatch.setattr(remote_code, "MODELING_SOURCE", source)
    with pytest.raises(RuntimeError, match="ropelab.config is a package"):
        remote_code.files_for_export()


def test_export_hf_run_falls_back_to_remote_code(tmp_path):
    config = build_run_config(overrides=[
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.vocab_size=320",
        "data.tokenizer=bytes", "data.seq_len=16", "model.rope.fraction=0.5", "model.rope.layout=interleaved",
    ])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.to_yaml())
    torch.manual_seed(0)
    save_weights_only(run_dir, 5, Transformer(config.model), config)

    info = export_hf(run_dir, tmp_path / "hf")
    assert info["route"] == "remote_code" and info["step"] == 5 and "layout=interleaved" in info["why"]
    assert info["tokenizer"] == "saved (bytes, 259 tokens)" and not list(tmp_path.glob(".tmp_*"))
    theirs = _load(tmp_path / "hf")
    assert theirs.generation_config.eos_token_id == 256 and theirs.generation_config.use_cache is not False
    ours = load(run_dir).model
    idx = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_logits_match(theirs(input_ids=idx).logits, ours(idx)[0], ours.config)

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # no trust_remote_code needed
    text = "x = 'é'\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(text.encode("utf-8")) and tokenizer.eos_token_id == 256
    with torch.no_grad():
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, _greedy(ours, ids, 4)) and tokenizer.decode(out[0]).startswith(text)
