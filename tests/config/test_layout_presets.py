"""The released-layout presets (`ropelab.config.layout_presets`) against transformers' config classes:
layer by layer, RoPE or NoPE, theta, rotated share, window and query temperature, and the shapes.
Configs only: no model is built."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from ropelab.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from ropelab.config.layout_presets import LAYOUT_PRESETS, TINY_WINDOW  # noqa: E402

# Published numbers transformers' defaults do not hold, from each model's config.json on the Hub.
SMOLLM3_3B = dict(rope_theta=5_000_000.0, max_position_embeddings=65_536)  # HuggingFaceTB/SmolLM3-3B
COMMAND_A = dict(  # CohereLabs/c4ai-command-a-03-2025
    vocab_size=256_000, hidden_size=12_288, intermediate_size=36_864, num_hidden_layers=64, num_attention_heads=96,
    num_key_value_heads=8, rope_theta=50_000.0, sliding_window=4096, sliding_window_pattern=4,
)
GEMMA3_1B = dict(  # google/gemma-3-1b-pt
    vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, sliding_window=512, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    sliding_window_pattern=6, max_position_embeddings=32_768, rms_norm_eps=1e-6,
)
# tiny-llama's shape, in HF's names, for the tiny presets
TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=384, num_hidden_layers=4)


def _hf_config(name: str):
    """The transformers config whose layout (and, for published shapes, whose shape) `name` reproduces."""
    tiny = name.startswith("tiny-")
    six = TINY | {"num_hidden_layers": 6}
    if "smollm3" in name:
        return transformers.SmolLM3Config(**(TINY | {"rope_theta": 5e6} if tiny else SMOLLM3_3B))
    if "llama4" in name:
        chunks = dict(attention_chunk_size=TINY_WINDOW, floor_scale=TINY_WINDOW, head_dim=64)
        return transformers.Llama4TextConfig(**(TINY | chunks if tiny else {}))
    if "command-a" in name:
        return transformers.Cohere2Config(**(TINY | dict(rope_theta=5e4, sliding_window=TINY_WINDOW) if tiny
                                             else COMMAND_A))
    if "gemma3" in name:
        return transformers.Gemma3TextConfig(**(six | dict(head_dim=64, sliding_window=TINY_WINDOW) if tiny
                                                else GEMMA3_1B))
    assert "gemma4" in name
    return transformers.Gemma4TextConfig(**(six | dict(head_dim=64, sliding_window=TINY_WINDOW) if tiny else {}))


def _rope_of_type(hf, layer_type: str) -> dict:
    params = hf.rope_parameters
    return params[layer_type] if layer_type in params else params


def hf_layers(hf) -> list[tuple]:
    """Per layer, as the transformers modeling code applies it: (rotated share or 0, theta, truncate
    spectrum, attention kind, window, query temperature)."""
    model_type, rows = hf.model_type, []
    for i, layer_type in enumerate(hf.layer_types):
        rope = _rope_of_type(hf, layer_type)
        if model_type in ("smollm3", "llama4_text"):
            rotates = bool(hf.no_rope_layers[i])
        else:  # Cohere2 rotates its sliding layers only; Gemma rotates every layer
            rotates = model_type != "cohere2" or layer_type == "sliding_attention"
        proportional = rope["rope_type"] == "proportional"
        share = rope.get("partial_rotary_factor", 1.0) if proportional else 1.0
        attention, window = {
            "full_attention": ("full", None),
            "sliding_attention": ("sliding", getattr(hf, "sliding_window", None)),
            "chunked_attention": ("chunked", getattr(hf, "attention_chunk_size", None)),
        }[layer_type]
        tuning = model_type == "llama4_text" and hf.attn_temperature_tuning and not rotates
        temperature = (float(hf.floor_scale), hf.attn_scale) if tuning else None
        rows.append((share if rotates else 0.0, float(rope["rope_theta"]), proportional and share < 1,
                     attention, window, temperature))
    return rows


def ropelab_layers(config: ModelConfig) -> list[tuple]:
    rows = []
    for i in range(config.n_layer):
        rope, kind = config.rope_for_layer(i), config.layer_kind(i)
        share = rope.resolve_dims(config.head_size) / config.head_size
        temperature = (kind.temperature.floor_scale, kind.temperature.attn_scale) if kind.temperature else None
        rows.append((share, rope.theta, share not in (0.0, 1.0) and rope.style == "truncate", kind.attention,
                     kind.window, temperature))
    return rows


@pytest.mark.parametrize("name", list(LAYOUT_PRESETS))
def test_preset_validates_and_is_registered(name):
    config = ModelConfig.from_name(name)
    config.validate()
    assert MODEL_PRESETS[name].name == name and config.layer_pattern and config.n_layer % len(config.layer_pattern) == 0


@pytest.mark.parametrize("name", list(LAYOUT_PRESETS))
def test_layout_is_the_hf_config_layer_by_layer(name):
    hf, config = _hf_config(name), ModelConfig.from_name(name)
    assert len(hf.layer_types) == config.n_layer
    assert ropelab_layers(config) == hf_layers(hf)


@pytest.mark.parametrize("name", [n for n in LAYOUT_PRESETS if not n.startswith("tiny-")])
def test_published_shape_is_the_hf_config(name):
    hf, config = _hf_config(name), ModelConfig.from_name(name)
    dense_width = getattr(hf, "intermediate_size_mlp", hf.intermediate_size)  # Llama 4: the dense MLP's width
    assert (config.vocab_size, config.n_layer, config.d_model, config.n_head, config.kv_heads, config.head_size,
            config.d_ff, config.tie_embeddings) == (
        hf.vocab_size, hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.to_dict().get("head_dim") or hf.hidden_size // hf.num_attention_heads, dense_width,
        hf.tie_word_embeddings)
    assert config.norm_eps == getattr(hf, "rms_norm_eps", getattr(hf, "layer_norm_eps", None))
    if name != "command-a":  # its config.json numbers above leave max_position_embeddings out
        assert config.max_seq_len == hf.max_position_embeddings


@pytest.mark.parametrize("name", [n for n in LAYOUT_PRESETS if n.startswith("tiny-")])
def test_tiny_preset_is_tiny_llama_with_the_layout(name):
    config, tiny = ModelConfig.from_name(name), ModelConfig.from_name("tiny-llama")
    shape = ("d_model", "n_head", "n_kv_head", "head_size", "d_ff", "block", "norm", "mlp", "tie_embeddings",
             "qk_norm", "vocab_size", "max_seq_len")
    assert {k: getattr(config, k) for k in shape} == {k: getattr(tiny, k) for k in shape}
    assert config.rope.layout == tiny.rope.layout
    windows = {config.layer_kind(i).window for i in range(config.n_layer)} - {None}
    assert windows <= {TINY_WINDOW}


def test_layout_presets_stay_plain_data():
    """YAML-like mappings: a preset's `model:` section in a run config builds the same ModelConfig."""
    from ropelab.config import build_run_config

    run = build_run_config({"model": dict(LAYOUT_PRESETS["tiny-llama4-irope"])})
    assert run.model == ModelConfig.from_name("tiny-llama4-irope")
