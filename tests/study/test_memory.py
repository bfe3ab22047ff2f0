import pytest
import torch

from ropelab.cli import main
from ropelab.config import ConfigError, LayerKind, ModelConfig, RopeConfig
from ropelab.model import Transformer
from ropelab.study.memory import cache_bytes, layer_kind_memory, memory_table, parse_entry, per_head_angles
from ropelab.study.memory import rotary_dims_for


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the tables' rows on one line each


@pytest.mark.parametrize("fraction", [0.0, "2ch", 0.1, 0.25, 1.0])
@pytest.mark.parametrize("head_dim, seq_len", [(64, 100), (32, 257)])
def test_reported_bytes_equal_the_models_allocation(fraction, head_dim, seq_len):
    config = ModelConfig(vocab_size=64, n_layer=2, d_model=head_dim * 2, n_head=2, d_ff=32)
    dims = rotary_dims_for(config, fraction)
    config.rope = RopeConfig(rotary_dims=dims)
    model = Transformer(config)
    model(torch.zeros(1, seq_len, dtype=torch.long))
    assert model.rope_cache_bytes() == cache_bytes(seq_len, dims, "ropelab")


def test_no_cache_policy_allocates_nothing():
    config = ModelConfig(vocab_size=64, n_layer=1, d_model=64, n_head=2, d_ff=32, rope=RopeConfig(cache="none"))
    model = Transformer(config)
    model(torch.zeros(1, 50, dtype=torch.long))
    assert model.rope_cache_bytes() == 0 == cache_bytes(50, 64, "none")


def test_table_scales_with_fraction_and_shards():
    rows = memory_table(["llama-3.2-1b"], fractions=[0.1, 1.0], seq_lens=[10_000_000], gpus=8)
    small, full = rows
    assert small["rotary_dims"] == 6 and full["rotary_dims"] == 64
    assert full["duplicated_bytes_replicated"] == 2 * 10_000_000 * 64 * 2
    assert full["duplicated_bytes_sharded"] * 8 == full["duplicated_bytes_replicated"]
    assert small["ropelab_bytes_replicated"] / full["ropelab_bytes_replicated"] == pytest.approx(6 / 64)


def _plan_model(rope: RopeConfig) -> Transformer:
    # head_dim 64 (32 pairs), 4 query heads in 2 KV groups
    return Transformer(ModelConfig(vocab_size=64, n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=32, rope=rope))


@pytest.mark.parametrize("rope", [RopeConfig(keep_pairs=4, select="uniform"), RopeConfig(pairs=[1, 5, 9, 30])])
def test_a_plan_shared_by_the_kv_heads_holds_one_table_of_its_pairs(rope):
    model = _plan_model(rope)
    model(torch.zeros(1, 100, dtype=torch.long))
    dims = rotary_dims_for(model.config, "pairs:4")
    # one table for both layers: cos + sin, 100 positions x 4 pairs x 4 bytes (fp32)
    assert dims == 8 and model.rope_cache_bytes() == 2 * 100 * 4 * 4 == cache_bytes(100, dims, "ropelab")


def test_a_plan_per_kv_head_holds_no_table_and_forms_k_by_r_angles_per_token():
    model = _plan_model(RopeConfig(pairs=[[0, 1, 2, 3], [4, 12, 20, 28]]))
    model(torch.zeros(1, 100, dtype=torch.long))
    assert model.rope_cache_bytes() == 0 == model.ropes[0].table_bytes(100)
    cos, sin = model.ropes[0].cos_sin(torch.arange(100)[None])
    assert cos.shape == sin.shape == (1, 2, 100, 4) and cos.dtype == torch.float32
    assert per_head_angles(model.config, 4) == 2 * 4 == cos[0, :, 0].numel()


def test_plan_entries_in_the_table_count_their_pairs():
    rows = memory_table(["llama-3.2-1b"], fractions=[parse_entry("pairs:4"), parse_entry("1")], seq_lens=[10_000_000],
                        gpus=8)
    plan, full = rows
    assert plan["fraction"] == "pairs:4" and plan["rotary_dims"] == 8 and full["rotary_dims"] == 64
    assert plan["ropelab_bytes_replicated"] == 2 * 10_000_000 * 4 * 4 == 320_000_000  # fp32 cos + sin of 4 pairs
    assert plan["ropelab_bytes_sharded"] == 40_000_000
    assert plan["duplicated_bytes_replicated"] == 2 * 10_000_000 * 8 * 2  # bf16 cos + sin, each pair twice
    assert full["ropelab_bytes_replicated"] == 8 * plan["ropelab_bytes_replicated"]


@pytest.mark.parametrize("entry", ["pairs:x", "pairs:-1", "pairs:", "1.5", "-0.1", "half", "nan"])
def test_bad_entries_name_the_argument(entry):
    with pytest.raises(ConfigError, match="^--fractions: "):
        parse_entry(entry)


def test_more_pairs_than_the_head_has_is_refused():
    config = ModelConfig.from_name("llama-3.2-1b")  # head_dim 64: 32 pairs
    assert rotary_dims_for(config, "pairs:32") == 64
    with pytest.raises(ConfigError, match="^--fractions: pairs:33: .*32 frequency pairs"):
        rotary_dims_for(config, "pairs:33")


def test_memory_command_reports_plans_and_what_per_head_plans_form(capsys, tmp_path, wide):
    assert main(["memory", "--presets", "llama-3.2-1b", "--fractions", "0.25,pairs:4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pairs:4" in out
    # llama-3.2-1b: 8 KV heads x 4 pairs = 32 angles; cos + sin in fp32: 256 bytes per token per layer
    assert "llama-3.2-1b: R=4: 32 angles, 256 bytes per token per layer" in out
    lines = (tmp_path / "memory.csv").read_text().splitlines()
    # then: position, mixing per token, KV cache (16 layers x keys and values of 8 x 64 bf16 per token), bias
    assert "llama-3.2-1b,pairs:4,8,2048,8,65536,8192,65536,8192,RoPE,0,67108864,0" in lines
    assert main(["memory", "--presets", "llama-3.2-1b", "--fractions", "pairs:40"]) == 2


def _layout() -> ModelConfig:
    # head_dim 32 (16 pairs), 2 KV heads: one token's keys and values in one layer are 2 x 2 x 32 x 2 = 256 bf16 bytes
    return ModelConfig(vocab_size=64, n_layer=8, d_model=128, n_head=4, n_kv_head=2, d_ff=32, layer_pattern="SSCG",
                       layer_kinds={"S": LayerKind(attention="sliding", window=100),
                                    "C": LayerKind(rope={"theta": 1e6}, attention="chunked", window=64),
                                    "G": LayerKind(rope="none")})


def test_layer_kind_rows_hold_tables_of_the_rope_layers_and_a_kv_cache_bounded_by_windows():
    rows = {r["kind"]: r for r in layer_kind_memory(_layout(), 300)}
    assert [rows[k]["layers"] for k in "SCG"] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    assert [rows[k]["rotary_dims"] for k in "SCG"] == [[32], [32], [0]]
    # one fp32 table per distinct RoPE setting: cos + sin, 300 positions x 16 pairs x 4 bytes; NoPE none
    assert [rows[k]["rope_table_bytes"] for k in "SCG"] == [38_400, 38_400, 0]
    # keys and values of the last 100 tokens (sliding), a chunk of 64 (chunked), all 300 (full)
    assert [rows[k]["kv_cache_bytes"] for k in "SCG"] == [4 * 100 * 256, 2 * 64 * 256, 2 * 300 * 256]
    short = {r["kind"]: r["kv_cache_bytes"] for r in layer_kind_memory(_layout(), 50, "fp32")}
    assert short == {"S": 4 * 50 * 512, "C": 2 * 50 * 512, "G": 2 * 50 * 512}  # windows longer than the sequence


def test_layer_kind_tables_equal_the_models_allocation():
    config = _layout()
    model = Transformer(config)
    model(torch.zeros(1, 300, dtype=torch.long))
    assert model.rope_cache_bytes() == sum(r["rope_table_bytes"] for r in layer_kind_memory(config, 300))


def test_a_model_without_a_pattern_is_one_row():
    (row,) = layer_kind_memory(ModelConfig.from_name("llama-3.2-1b"), 2048)
    assert row["kind"] == "-" and row["layers"] == list(range(16)) and row["attention"] == "full"
    assert row["kv_cache_bytes"] == 16 * 2 * 8 * 64 * 2048 * 2 and row["rope_table_bytes"] == cache_bytes(2048, 64)


def test_memory_command_prints_a_configs_layer_kinds(capsys, tmp_path, wide):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny-llama, layer_pattern: LLLG, layer_kinds: {L: {attention: sliding, window: 64}, "
                    "G: {rope: none, temperature: {floor_scale: 8192, attn_scale: 0.1}}}}\n")
    assert main(["memory", "--presets", "tiny-llama", "--fractions", "1", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    # tiny-llama: head_dim 64, 1 KV head; at 8,192 tokens: L holds 3 x 64 tokens x 256 bytes
    assert "sliding 64" in out and "49,152 B" in out and "0,1,2" in out


def test_position_entries_name_registered_types_and_are_checked_as_a_list():
    assert [parse_entry(text) for text in ("alibi", " fope", "rope+alibi", "nope")] == ["alibi", "fope", "rope+alibi",
                                                                                        "nope"]
    with pytest.raises(ConfigError, match=r"^--fractions: rope\+fope\[1\]: a second rotation entry"):
        parse_entry("rope+fope")
    with pytest.raises(ConfigError, match=r"^--fractions: 'xpe': must be .* position types joined by \+ \(rope, nope"):
        parse_entry("xpe")


def test_rope_fope_alibi_and_nope_side_by_side():
    rows = memory_table(["tiny-llama"], fractions=["rope", "fope", "alibi", "nope", "rope+alibi"], seq_lens=[1000])
    by = {row["fraction"]: row for row in rows}
    assert {entry: row["position"] for entry, row in by.items()} == {
        "rope": "RoPE", "fope": "FoPE", "alibi": "ALiBi", "nope": "NoPE", "rope+alibi": "RoPE + ALiBi"}
    assert [by[e]["rotary_dims"] for e in by] == [64, 64, 0, 0, 64]
    # FoPE reads RoPE's table (then mixes it): the same bytes; no rotation, no table
    assert by["fope"]["ropelab_bytes_replicated"] == by["rope"]["ropelab_bytes_replicated"] == cache_bytes(1000, 64)
    assert by["alibi"]["ropelab_bytes_replicated"] == by["nope"]["ropelab_bytes_replicated"] == 0
    # tiny-llama: 4 layers, 1 KV head of 64; keys and values in bf16, whatever the encoding
    assert {row["kv_cache_bytes"] for row in rows} == {4 * 2 * 64 * 1000 * 2}
    # 2 heads x 1000 x 1000, an fp32 bias and its bf16 mask; 32 pairs mixed by two 32 x 32 matrices
    assert [by[e]["score_bias_bytes"] for e in by] == [0, 0, 2 * 1000 * 1000 * 6, 0, 2 * 1000 * 1000 * 6]
    assert [by[e]["mixing_macs_per_token"] for e in by] == [0, 2 * 32 * 32, 0, 0, 0]


def _bias_config() -> ModelConfig:
    return ModelConfig(vocab_size=64, n_layer=3, d_model=128, n_head=4, n_kv_head=2, d_ff=32,
                       position_layers={1: [{"type": "rope", "fraction": 0.5}, {"type": "alibi"}], 2: [{"type": "alibi"}]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries, keys", [(37, 37), (1, 52)])  # a forward, a cached decode step
def test_score_bias_bytes_are_the_tensors_attention_holds(monkeypatch, dtype, queries, keys):
    import ropelab.attention as attention
    from ropelab.position import SCORE_BIASES
    from ropelab.study.memory import DTYPE_BYTES, score_bias_bytes

    config = _bias_config()
    (entry,) = [e for e in config.positions_for_layer(2) if e.type.channel == "score_bias"]
    module, held = SCORE_BIASES[entry.type.name](entry.spec, config.n_head), []
    original_bias, original_sdpa = module.bias, attention.sdpa
    monkeypatch.setattr(module, "bias", lambda *a: held.append(original_bias(*a)) or held[-1])
    monkeypatch.setattr(attention, "sdpa", lambda q, k, v, mask, causal: held.append(mask) or
                        original_sdpa(q, k, v, mask, causal))
    q = torch.randn(1, config.n_head, queries, config.head_size, dtype=dtype)
    k = v = torch.randn(1, config.n_head, keys, config.head_size, dtype=dtype)
    attention.attend(q, k, v, backend="sdpa", score_bias=module)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert len({t.data_ptr() for t in held}) == 2  # the bias and the mask made from it (fp32: the masked copy)
    assert score_bias_bytes(config, 2, queries, keys, name) == sum(t.numel() * t.element_size() for t in held)
    assert DTYPE_BYTES[name] == dtype.itemsize
    assert score_bias_bytes(config, 0, queries, keys, name) == 0 == score_bias_bytes(config, 2, queries, keys, name, "flex")


def test_kv_cache_bytes_are_what_a_kv_cache_holds_layer_by_layer():
    from ropelab.kv_cache import KVCache
    from ropelab.study.memory import kv_cache_bytes

    config = _bias_config()
    model, cache = Transformer(config), KVCache()
    with torch.no_grad():
        model(torch.zeros(1, 29, dtype=torch.long), kv_cache=cache)
    held = [k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(cache.keys, cache.values)]
    assert held == [kv_cache_bytes(config, layer, 29, "fp32") for layer in range(3)]
    rows = {r["kind"]: r for r in layer_kind_memory(config, 29, "fp32")}
    assert rows["-"]["position"] == "RoPE, RoPE + ALiBi, ALiBi" and rows["-"]["kv_cache_bytes"] == sum(held)


def test_fopes_mixing_is_the_multiply_adds_its_rotation_does_per_token():
    from torch.utils.flop_counter import FlopCounterMode

    from ropelab.position.registry import build_rotation
    from ropelab.study.memory import angles_per_token, mixing_macs_per_token

    config = ModelConfig(vocab_size=64, n_layer=2, d_model=128, n_head=2, d_ff=32,
                         position_layers={1: [{"type": "fope", "trained_length": 64, "fraction": 0.5}]})
    positions = torch.arange(50)[None]
    flops = []
    for layer in (0, 1):
        rotation = build_rotation(config, layer)
        with FlopCounterMode(display=False) as counter:
            rotation.cos_sin(positions)
        flops.append(counter.get_total_flops())
    assert mixing_macs_per_token(config, 0) == 0 and mixing_macs_per_token(config, 1) == 2 * 16 * 16
    assert flops[1] - flops[0] == 2 * 50 * mixing_macs_per_token(config, 1)  # a multiply-add is two flops
    none = ModelConfig(vocab_size=64, n_layer=1, d_model=128, n_head=2, d_ff=32, rope=RopeConfig(cache="none"))
    assert angles_per_token(none, 0) == 32 and angles_per_token(config, 0) == 0  # a table: looked up, not formed
    cos, _ = build_rotation(none, 0).cos_sin(positions)
    assert cos[..., 0, :].numel() == angles_per_token(none, 0)


def test_memory_command_compares_encodings_and_a_configs_per_layer_lists(capsys, tmp_path, wide):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny-llama, position_layers: {3: [{type: alibi}]}}\n")
    assert main(["memory", "--presets", "tiny-llama", "--fractions", "rope,fope,alibi,nope", "--config", str(path),
                 "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "FoPE" in out and "ALiBi" in out and "NoPE" in out and "RoPE + ALiBi" not in out
    assert "tiny-llama fope: a learned rotation mixes its cos/sin on every call: 2,048 multiply-adds" in out
    assert "RoPE, ALiBi" in out  # the config's one kind: layers 0-2 RoPE, layer 3 ALiBi
    assert "50,331,648 B" in out  # layer 3's bias at 2,048 tokens: 2 heads x 2048^2 x (4 + 2) bytes
    # 4 layers x keys and values of 64 bf16 numbers x 2,048 tokens; 2 heads x 2048^2 x 6 bytes
    assert "tiny-llama,alibi,0,2048,8,0,0,0,0,ALiBi,0,2097152,50331648" in (tmp_path / "m" / "memory.csv").read_text()
