"""Per-layer layouts in the model (`model.layer_pattern`, `model.layer_kinds`): each layer's window, RoPE and
NoPE query temperature against hand-built references and HF's Llama 4 attention; per-layer RoPE switches;
training with a layout."""

import math

import pytest
import torch

from ropelab.attention import Documents
from ropelab.config import ConfigError, LayerKind, ModelConfig, QueryTemperature, RopeConfig, build_run_config
from ropelab.kv_cache import KVCache
from ropelab.model import Transformer, query_temperature
from ropelab.rope import layer_frequencies
from ropelab.sources import load
from ropelab.train.loop import train
from ropelab.train.phases import resolve_phases

TINY = dict(vocab_size=97, n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=256)
TEMPERATURE = QueryTemperature(floor_scale=4, attn_scale=0.5)  # factors above 1 within a few tokens


def temperature_at(temperature: QueryTemperature, position: int) -> float:
    """Llama 4's factor at one position, in float64: 1 + attn_scale * log1p(floor((p + 1) / floor_scale))."""
    return 1.0 + temperature.attn_scale * math.log1p(math.floor((position + 1.0) / temperature.floor_scale))


def _model(pattern=None, kinds=None, seed=0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(**{**TINY, **overrides}, layer_pattern=pattern, layer_kinds=kinds or {})
    model = Transformer(config).eval()
    with torch.no_grad():  # weights away from the init, so attention is far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _reference_attention(attn, x, position_ids, visible, temperature=None):
    """The layer's attention by hand: projections, (temperature,) RoPE, softmax under the dense mask `visible`."""
    B, T, _ = x.shape
    H, K, D = attn.n_head, attn.n_kv_head, attn.head_dim
    q = attn.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, K, D).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, K, D).transpose(1, 2)
    if temperature is not None:
        factors = torch.tensor([temperature_at(temperature, p) for p in position_ids[0].tolist()])
        q = q * factors[:, None]
    q, k = attn.rope(q, k, position_ids)
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return attn.o_proj((weights @ v).transpose(1, 2).reshape(B, T, H * D))


def _window_mask(T, attention, size, doc_ids=None):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = j <= i
    if attention == "sliding":
        visible &= i - j < size
    elif attention == "chunked":
        visible &= i // size == j // size
    if doc_ids is not None:
        visible = visible & (doc_ids[:, :, None] == doc_ids[:, None, :])
        return visible[:, None]
    return visible


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("backend", ["auto", "dense"])
@pytest.mark.parametrize("attention, size", [("sliding", 5), ("chunked", 6), ("full", None)])
def test_a_windowed_layer_equals_attention_under_the_explicit_dense_mask(attention, size, backend, documents):
    kind = LayerKind(attention=attention, window=size)
    model = _model("LF", {"L": kind, "F": LayerKind()})
    model.set_attention_backend(backend)
    attn = model.blocks[2].attn  # pattern LF repeated: layer 2 is an L
    assert attn.window == (None if attention == "full" else (attention, size))
    T = 23
    torch.manual_seed(1)
    x = torch.randn(2, T, 32)
    positions = torch.arange(T).expand(2, T)
    doc_ids = torch.tensor([[0] * 9 + [1] * 14, [0] * 17 + [1] * 6]) if documents else None
    with torch.no_grad():
        got = attn(x, positions, None if doc_ids is None else Documents(doc_ids))
        expected = _reference_attention(attn, x, positions, _window_mask(T, attention, size, doc_ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_cached_forward_of_a_layout_equals_the_full_forward():
    model = _model("SCG", {"S": LayerKind(attention="sliding", window=4), "C": LayerKind(attention="chunked", window=5),
                           "G": LayerKind(rope="none", temperature=TEMPERATURE)}, n_layer=3)
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        full, _ = model(ids)
        cache = KVCache()
        pieces = [model(ids[:, :7], kv_cache=cache)[0]] + [model(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(7, 19)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_temperature_factor_is_llama4s_formula_rounded_to_the_query_dtype(dtype):
    q = torch.randn(2, 3, 40, 8).to(dtype)
    positions = torch.stack([torch.arange(40), torch.arange(100, 140)])
    got = query_temperature(q, positions, TEMPERATURE)
    factors = torch.tensor([[temperature_at(TEMPERATURE, p) for p in row] for row in positions.tolist()])  # (B, T) in float64
    assert got.dtype == dtype and factors.max() > 2
    expected = q.double() * factors[:, None, :, None]
    tolerance = 2**-22 if dtype == torch.float32 else 2**-8  # the factor and the product each rounded
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=0)
    assert factors[0, 2] == 1.0 and factors[0, 3] == 1 + 0.5 * math.log(2)  # floor((p + 1) / 4) steps at p = 3


def test_a_nope_layer_with_temperature_equals_the_hand_built_reference():
    model = _model("RN", {"R": LayerKind(), "N": LayerKind(rope="none", temperature=TEMPERATURE)})
    attn = model.blocks[1].attn
    assert attn.rope.rotary_dims == 0 and attn.temperature == TEMPERATURE
    assert model.blocks[0].attn.temperature is None
    x = torch.randn(1, 30, 32)
    positions = torch.arange(30)[None]
    with torch.no_grad():
        expected = _reference_attention(attn, x, positions, _window_mask(30, "full", None), TEMPERATURE)
        torch.testing.assert_close(attn(x, positions, None), expected, rtol=1e-5, atol=1e-5)
        attn.temperature = None
        assert not torch.allclose(attn(x, positions, None), expected, atol=1e-3)


def test_a_nope_layer_with_temperature_matches_hf_llama4_attention():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    model = _model("RN", {"R": LayerKind(), "N": LayerKind(rope="none", temperature=TEMPERATURE)})
    ours = model.blocks[1].attn
    config = transformers.Llama4TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
        no_rope_layers=[1, 0], use_qk_norm=False, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        attention_bias=False)
    config._attn_implementation = "sdpa"
    hf = Llama4TextAttention(config, layer_idx=1).eval()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(hf, name).load_state_dict(getattr(ours, name).state_dict())
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        expected, _ = hf(x, position_embeddings=None, attention_mask=None)
        got = ours(x, torch.arange(40).expand(2, 40), None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_pattern_as_long_as_the_model_sets_every_layer():
    kinds = {"A": LayerKind(rope={"theta": 100.0}), "B": LayerKind(attention="sliding", window=3),
             "C": LayerKind(rope={"fraction": 0.5}, attention="chunked", window=4),
             "D": LayerKind(rope="none", temperature=TEMPERATURE)}
    model = _model("ABCD", kinds)
    attn = [block.attn for block in model.blocks]
    assert [a.window for a in attn] == [None, ("sliding", 3), ("chunked", 4), None]
    assert [a.temperature for a in attn] == [None, None, None, TEMPERATURE]
    assert [a.rope.rotary_dims for a in attn] == [8, 8, 4, 0]
    assert [a.rope.theta for a in attn[:3]] == [100.0, 10_000.0, 10_000.0]
    assert len(model.ropes) == 4


def test_layers_with_one_rope_setting_share_one_module():
    model = _model("LLG", {"L": LayerKind(attention="sliding", window=8), "G": LayerKind(rope={"theta": 1e6})},
                   n_layer=6)
    ropes = [block.attn.rope for block in model.blocks]
    assert len(model.ropes) == 2 and ropes[0] is ropes[1] is ropes[3] is ropes[4] and ropes[2] is ropes[5]
    assert ropes[2].theta == 1e6 and ropes[0].theta == 10_000.0


def test_windows_count_fewer_attended_tokens_in_the_flops():
    full = _model()
    windowed = _model("LG", {"L": LayerKind(attention="sliding", window=16), "G": LayerKind()})
    per_layer = 12 * 4 * 8  # 12 * heads * head_dim per attended token and layer
    assert full.flops_per_token(64) - windowed.flops_per_token(64) == 2 * per_layer * (64 - 16)
    assert full.flops_per_token(8) == windowed.flops_per_token(8)  # a window longer than the sequence


def _frequencies(model: Transformer) -> list[torch.Tensor]:
    return [block.attn.rope.inv_freq for block in model.blocks]


def test_set_rope_follows_each_layers_kind_and_splits_a_shared_module():
    kinds = {"L": LayerKind(attention="sliding", window=8), "G": LayerKind()}
    model = _model("LLG", kinds, n_layer=6)
    assert len(model.ropes) == 1  # G has no RoPE of its own yet: every layer shares model.rope
    phase = ModelConfig(**TINY | {"n_layer": 6}, layer_pattern="LLG",
                        layer_kinds={"L": kinds["L"], "G": LayerKind(rope={"theta": 1e6})}, rope=RopeConfig(theta=500.0))
    model.set_rope(phase)
    built = Transformer(phase)
    for layer, (got, expected) in enumerate(zip(_frequencies(model), _frequencies(built))):
        assert torch.equal(got, expected), layer
    assert [block.attn.rope.theta for block in model.blocks] == [500.0, 500.0, 1e6] * 2
    assert len(model.ropes) == 2 and model.config.rope.theta == 500.0
    assert model.config.layer_kinds["G"].rope == {"theta": 1e6}
    ids = torch.randint(0, 97, (1, 20))
    built.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], built.eval()(ids)[0], rtol=0, atol=0)


def test_a_two_phase_run_changes_only_the_rope_of_kind_g(monkeypatch, tmp_path, tiny_overrides):
    """Phase 2 raises kind G's theta: from its first step G's layers turn at 1e6, the L layers stay at 10k."""
    seen, set_rope = [], Transformer.set_rope

    def recording(self, config):
        set_rope(self, config)
        seen.append([block.attn.rope.inv_freq.clone() for block in self.blocks])

    monkeypatch.setattr(Transformer, "set_rope", recording)
    config = build_run_config(
        {"model": {"layer_pattern": "LG", "layer_kinds": {"L": {"attention": "sliding", "window": 8}, "G": {}}}},
        overrides=[*tiny_overrides, "train.eval_every=2", "train.checkpoint_every=2",
                   "train.phases=[{name: short, steps: 2}, {name: long, steps: 2}]",
                   "train.phases[1].overrides.model.layer_kinds.G.rope.theta=1000000"])
    result = train(config, tmp_path / "run")
    assert math.isfinite(result.final_val_loss)
    head_dim = config.model.head_size
    at = {theta: layer_frequencies(RopeConfig(theta=theta), head_dim) for theta in (10_000.0, 1e6)}
    assert len(seen) == 2
    assert all(torch.equal(f, at[10_000.0]) for f in seen[0])
    assert [torch.equal(f, at[theta]) for f, theta in zip(seen[1], (10_000.0, 1e6))] == [True, True]


def test_training_two_steps_with_a_layout_gives_a_finite_loss(tmp_path, tiny_overrides):
    config = build_run_config(
        {"model": {"layer_pattern": "LG", "layer_kinds": {
            "L": {"attention": "chunked", "window": 8},
            "G": {"rope": "none", "temperature": {"floor_scale": 4, "attn_scale": 0.1}}}}},
        overrides=[*tiny_overrides, "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2",
                   "attention.doc_mask=true"])
    result = train(config, tmp_path / "run")
    assert math.isfinite(result.final_val_loss) and math.isfinite(result.final_train_loss)
    loaded = load(tmp_path / "run").model
    assert [block.attn.window for block in loaded.blocks] == [("chunked", 8), None]
    assert loaded.blocks[1].attn.temperature == QueryTemperature(floor_scale=4, attn_scale=0.1)


@pytest.mark.parametrize("layout, message", [
    ({"layer_pattern": "LLG"}, r"model.layer_pattern='LLG': its length 3 must divide model.n_layer=4"),
    ({"layer_pattern": "LLLX"}, r"layer kind 'X' is not in model.layer_kinds \(defined: G, L\)"),
    ({"layer_kinds": {"L": {"attention": "sliding", "window": 0}}}, r"model.layer_kinds.L.window=0: must be > 0"),
    ({"layer_kinds": {"L": {"attention": "sliding"}}}, r"model.layer_kinds.L.window: required for attention: sliding"),
    ({"layer_kinds": {"L": {"attention": "full", "window": 8}}}, r"model.layer_kinds.L.window=8: only for attention"),
    ({"layer_kinds": {"G": {"rope": {"theta": 1e6}, "temperature": {}}}},
     r"model.layer_kinds.G.temperature: only for NoPE layers .* set rope: none"),
    ({"layer_kinds": {"G": {"rope": "nope"}}}, r"model.layer_kinds.G.rope='nope': must be a mapping"),
    ({"layer_kinds": {"GG": {"rope": "none"}}}, r"model.layer_kinds.GG: a layer kind is named by one character"),
])
def test_bad_layouts_stop_in_one_line(layout, message):
    model = {"preset": "tiny-llama", "layer_pattern": "LLLG",
             "layer_kinds": {"L": {"attention": "sliding", "window": 8}, "G": {"rope": "none"}}}
    model = {**model, **{k: v if k != "layer_kinds" else {**model["layer_kinds"], **v} for k, v in layout.items()}}
    if "GG" in model["layer_kinds"]:
        del model["layer_kinds"]["G"]
        model["layer_pattern"] = "LLLL"
    with pytest.raises(ConfigError, match=message) as info:
        build_run_config({"model": model})
    assert "\n" not in str(info.value)


def test_a_window_longer_than_every_training_window_is_refused_before_the_run_folder(tmp_path, tiny_overrides):
    layout = ["model.layer_pattern=LG", "model.layer_kinds={L: {attention: sliding, window: 100}, G: {rope: none}}"]
    config = build_run_config(overrides=[*tiny_overrides, "data.seq_len=64", *layout])
    with pytest.raises(ConfigError, match=r"model.layer_kinds.L.window=100: larger than the longest training window "
                                          r"data.seq_len=64"):
        train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    phases = ["train.phases=[{name: a, steps: 1}, {name: b, steps: 1, overrides: {data.seq_len: 128}}]"]
    resolve_phases(build_run_config(overrides=[*tiny_overrides, "data.seq_len=64", *layout, *phases]))  # fits phase 2


def test_none_is_nope_whatever_model_rope_sets():
    config = build_run_config({"model": {"preset": "tiny-llama", "rope": {"rotary_dims": 16, "scaling": {
        "method": "linear", "factor": 2.0}}, "layer_pattern": "RN", "layer_kinds": {"R": {}, "N": {"rope": "none"}}}})
    assert config.model.rope_for_layer(1).resolve_dims(64) == 0 and config.model.rope_for_layer(1).scaling is None
    assert config.model.rope_for_layer(0).resolve_dims(64) == 16
