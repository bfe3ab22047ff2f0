"""ropelab <-> Hugging Face parity: same logits (fp32, within what rounding explains: tests/helpers.py's
parity_tolerance) and same parameter counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelab.config import MODEL_PRESETS, ModelConfig, RopeConfig  # noqa: E402
from ropelab.sources.hf import from_hf, to_hf  # noqa: E402
from ropelab.sources.hf_config_write import hf_architecture, hf_config_for  # noqa: E402
from ropelab.model import Transformer, count_params_meta  # noqa: E402
from tests.helpers import assert_logits_match  # noqa: E402

VOCAB, T = 128, 24
TINY = dict(vocab_size=VOCAB, n_layer=2, d_model=64, n_head=4, d_ff=96, max_seq_len=256)
LLAMA = ModelConfig(name="tiny-llama-gqa", n_kv_head=2, rope=RopeConfig(theta=500.0), **TINY)
QWEN3 = dataclasses.replace(LLAMA, name="tiny-qwen3", qk_norm=True, attn_bias=True)
NEOX = ModelConfig(
    name="tiny-neox", block="parallel", norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True,
    rope=RopeConfig(fraction=0.25), **TINY,
)
HF_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
    max_position_embeddings=256,
)


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial values everywhere: norms around 1 (with noise), biases and weights around 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1
            is_norm_weight = "norm" in name and name.endswith("weight")
            p.copy_(1.0 + noise if is_norm_weight else noise)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def _assert_same_logits(ours: Transformer, theirs) -> None:
    """ropelab forms RoPE angles in float64, transformers in float32 (both in bf16 too)."""
    idx = _tokens()
    with torch.no_grad():
        a = ours(idx)[0]
        b = theirs(input_ids=idx).logits
    assert a.shape == (2, T, VOCAB) and a.dtype == b.dtype
    assert_logits_match(a, b, ours.config, angles_differ=True)


def _hf(class_name: str, config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, class_name)._from_config(config, dtype=torch.float32, attn_implementation="eager")
    _randomize(model)
    return model.eval()


def _ropelab(config: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(config))
    _randomize(model)
    return model.eval()


# ------------------------------------------------------------------ ropelab -> HF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "config, hf_class",
    [(LLAMA, "LlamaForCausalLM"), (QWEN3, "Qwen3ForCausalLM"), (NEOX, "GPTNeoXForCausalLM")],
    ids=["llama-gqa", "qwen3-qknorm", "neox-parallel-0.25"],
)
def test_to_hf_logits_match(config, hf_class, dtype):
    ours = _ropelab(config)
    theirs = to_hf(ours, attn_implementation="eager")
    assert type(theirs).__name__ == hf_class
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_params()
    _assert_same_logits(ours.to(dtype), theirs.to(dtype))


def test_to_hf_neox_rotary_pct_and_tied_embeddings():
    config = dataclasses.replace(NEOX, tie_embeddings=True, rope=RopeConfig(rotary_dims=6, theta=1234.0))
    hf_config = hf_config_for(config)
    assert hf_config.use_parallel_residual and hf_config.tie_word_embeddings
    ours = _ropelab(config)
    theirs = to_hf(ours, attn_implementation="eager")
    assert theirs.gpt_neox.layers[0].attention.rotary_ndims == 6
    _assert_same_logits(ours, theirs)


# ------------------------------------------------------------------ HF -> ropelab


def _rope(theta: float, **extra) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **extra}}


HF_CASES = {
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, **_rope(500.0))),
    "llama-bias-tied": (
        "LlamaForCausalLM", "LlamaConfig",
        dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, **_rope(1e4)),
    ),
    "neox-parallel-0.25": (
        "GPTNeoXForCausalLM", "GPTNeoXConfig",
        dict(hidden_act="gelu", use_parallel_residual=True, **_rope(10_000.0, partial_rotary_factor=0.25)),
    ),
    "neox-sequential-0.5": (
        "GPTNeoXForCausalLM", "GPTNeoXConfig",
        dict(hidden_act="gelu", use_parallel_residual=False, **_rope(2_000.0, partial_rotary_factor=0.5)),
    ),
    "qwen3-qknorm": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=2, head_dim=16, **_rope(1e6))),
    "qwen2-biases": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2, **_rope(1e6))),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_from_hf_logits_match(case):
    model_class, config_class, kwargs = HF_CASES[case]
    theirs = _hf(model_class, getattr(transformers, config_class)(**HF_COMMON, **kwargs))
    ours = from_hf(theirs)
    zero_o_bias = 2 * 64 if case == "qwen2-biases" else 0  # Qwen2 lacks o_proj.bias: a zero bias here
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters()) + zero_o_bias
    _assert_same_logits(ours, theirs)


@pytest.mark.parametrize("weight", ["blocks.1.attn.k_proj.weight", "blocks.0.mlp_norm.weight"])
def test_one_weight_off_by_one_percent_fails_the_parity_check(weight):
    """A conversion error far smaller than a real one, one element 1% off, is beyond the tolerance."""
    model_class, config_class, kwargs = HF_CASES["llama-gqa"]
    theirs = _hf(model_class, getattr(transformers, config_class)(**HF_COMMON, **kwargs))
    ours = from_hf(theirs)
    with torch.no_grad():
        ours.get_parameter(weight).view(-1)[0] *= 1.01
    with pytest.raises(AssertionError, match="logits differ"):
        _assert_same_logits(ours, theirs)


def test_from_hf_reads_configuration():
    _, _, kwargs = HF_CASES["qwen2-biases"]
    ours = from_hf(_hf("Qwen2ForCausalLM", transformers.Qwen2Config(**HF_COMMON, **kwargs)))
    assert ours.config.attn_bias and ours.config.kv_heads == 2 and ours.config.rope.theta == 1e6
    assert torch.count_nonzero(ours.blocks[0].attn.o_proj.bias) == 0  # Qwen2 has no o_proj bias
    _, _, kwargs = HF_CASES["neox-parallel-0.25"]
    ours = from_hf(_hf("GPTNeoXForCausalLM", transformers.GPTNeoXConfig(**HF_COMMON, **kwargs)))
    assert ours.config.block == "parallel" and ours.ropes[0].rotary_dims == 4 and ours.config.rope.style == "slice"


def test_round_trip_is_exact():
    ours = _ropelab(QWEN3)
    back = from_hf(to_hf(ours))
    assert back.config.qk_norm and back.config.kv_heads == 2
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(rope=RopeConfig(fraction=0.5)), "rotates every channel"),
        (dict(rope=RopeConfig(layout="interleaved")), "layout=interleaved"),
        (dict(block="parallel"), "block=parallel"),
        (dict(mlp="gelu"), "no Hugging Face class pairs"),
        (dict(rope_layers={1: {"theta": 5.0}}), "rope_layers"),
    ],
)
def test_unsupported_llama_shapes_raise(change, reason):
    with pytest.raises(ValueError, match=reason):
        hf_architecture(dataclasses.replace(LLAMA, **change))


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(rope=RopeConfig(fraction=0.25, style="truncate")), "slice frequencies"),
        (dict(n_kv_head=2), "grouped-query"),
        (dict(mlp_bias=False), "mlp_bias"),
        (dict(qk_norm=True), "QK-norm"),
    ],
)
def test_unsupported_neox_shapes_raise(change, reason):
    with pytest.raises(ValueError, match=reason):
        hf_architecture(dataclasses.replace(NEOX, **change))


# ------------------------------------------------------------------ parameter counts of the presets


def _preset_hf_config(name: str, config: ModelConfig):
    """The HF config of the same shape, written out by hand (independent of the adapter)."""
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.d_model, num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head, intermediate_size=config.d_ff,
        tie_word_embeddings=config.tie_embeddings,
    )
    if name in ("tiny-pythia", "pythia-1b"):
        return "GPTNeoXForCausalLM", transformers.GPTNeoXConfig(
            **common, attention_bias=True, **_rope(10_000.0, partial_rotary_factor=0.25)
        )
    # Llama shapes; pythia-1b-released is 8 heads of 256 with RMSNorm/SwiGLU, no biases.
    return "LlamaForCausalLM", transformers.LlamaConfig(
        **common, num_key_value_heads=config.kv_heads, head_dim=config.head_size, **_rope(config.rope.theta)
    )


# the layout presets are checked in tests/config/test_layout_presets.py
@pytest.mark.parametrize("name", [name for name, preset in MODEL_PRESETS.items() if not preset.layer_pattern])
def test_preset_param_count_matches_hf(name):
    config = ModelConfig.from_name(name)
    if config.vocab_size is None:
        config.vocab_size = 4096
    model_class, hf_config = _preset_hf_config(name, config)
    with torch.device("meta"):
        hf_model = getattr(transformers, model_class)(hf_config)
    assert sum(p.numel() for p in hf_model.parameters()) == count_params_meta(config)
    if name != "pythia-1b-released":  # the others convert exactly; their adapter config has the same count
        with torch.device("meta"):
            adapted = getattr(transformers, model_class)(hf_config_for(config))
        assert sum(p.numel() for p in adapted.parameters()) == count_params_meta(config)
