"""Every registered position encoding (`ropelab.config.position.POSITION_TYPES`) through every path:
built on the meta device and loaded, KV-cached decoding against a full forward, in-place against
reference gradients (learned parameters get theirs), weight decay, export route and logits,
extrapolation accepted or refused, and its answers for the cos/sin memory. A type registered without
a case here, or without its module, fails `test_every_registered_type_has_its_module_and_answers`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ropelab.config import ConfigError, RunConfig, TrainConfig, build_run_config
from ropelab.config.position import POSITION_TYPES
from ropelab.config.rope import RopeScalingConfig
from ropelab.evaluate.extrapolation import ExtrapolationSettings, plan_cells, rotates, scaling_refusal
from ropelab.kv_cache import KVCache
from ropelab.model import Transformer
from ropelab.position import ATTENTIONS, ROTATIONS, SCORE_BIASES, position_parameters
from ropelab.train.optim import build_optimizer
from tests.position import temperature_attention

VOCAB, T = 64, 24
# one model per registered type: its position list, and the export route it must take
CASES = {
    "rope": ("[{type: rope}]", "native"),
    "nope": ("[{type: nope}]", "remote_code"),
    "fope": ("[{type: fope, trained_length: 16}]", "remote_code"),
    "alibi": ("[{type: rope, fraction: 0.25}, {type: alibi}]", "remote_code"),
    # registered by the tests only (`registered_in_tests`): a whole-attention override
    # (the shipped modeling code has ropelab's registry only, so its export is refused)
    temperature_attention.NAME: ("[{type: rope}, {type: test_temperature, temperature: 1.5}]", "refused"),
}
MODULES = {"rotation": ROTATIONS, "score_bias": SCORE_BIASES, "attention": ATTENTIONS}


@pytest.fixture(scope="module", autouse=True)
def registered_in_tests():
    with temperature_attention.registered():
        yield


def _config(name: str, *overrides: str) -> RunConfig:
    return build_run_config(overrides=[f"model.position={CASES[name][0]}", f"model.vocab_size={VOCAB}",
                                       "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2",
                                       *overrides])


def _model(name: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(_config(name).model)
    with torch.no_grad():  # FoPE's coefficients and every weight away from their initial values
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def test_every_registered_type_has_its_module_and_answers():
    assert set(CASES) == set(POSITION_TYPES), "give each registered type a case (and its module)"
    for name, kind in POSITION_TYPES.items():
        assert name in MODULES[kind.channel], f"{name}: registered without a module for channel {kind.channel}"


@pytest.mark.parametrize("name", CASES)
def test_a_model_built_on_the_meta_device_and_loaded_computes_the_same(name):
    """ALiBi's slopes are a non-persistent buffer: without the rebuild hook they are uninitialised memory."""
    model = _model(name)
    loaded = Transformer(_config(name).model, init=False)
    loaded.load_state_dict(model.state_dict())
    for ours, theirs in zip(model.buffers(), loaded.buffers()):
        assert torch.equal(ours, theirs)
    with torch.no_grad():
        assert torch.equal(model(_ids())[0], loaded(_ids())[0])


@pytest.mark.parametrize("name", CASES)
def test_kv_cached_decoding_gives_the_full_forwards_logits(name):
    model, ids = _model(name), _ids()
    cache, pieces, start = KVCache(), [], 0
    with torch.no_grad():
        full = model(ids)[0]
        for end in (9, 10, 17, T):
            pieces.append(model(ids[:, start:end], kv_cache=cache)[0])
            start = end
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-5)


def _gradients(model: Transformer, inplace) -> dict[str, torch.Tensor]:
    for rope in model.ropes:
        rope.inplace = inplace
    model.train()
    model.zero_grad()
    model(_ids(), targets=_ids(2))[1].backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", CASES)
def test_the_default_path_gives_the_reference_gradients_and_learned_parameters_get_theirs(name):
    model = _model(name)
    default, reference = _gradients(model, None), _gradients(model, False)
    assert default.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(default[key], reference[key], atol=1e-6, rtol=1e-5)
    learned = position_parameters(model)
    assert bool(learned) == POSITION_TYPES[name].learned
    for parameter_name, parameter in model.named_parameters():
        if id(parameter) in learned:
            assert parameter_name in default and default[parameter_name].abs().sum() > 0, parameter_name


@pytest.mark.parametrize("name", CASES)
def test_learned_position_parameters_are_not_shared_nor_decayed(name):
    model = _model(name)
    learned = position_parameters(model)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] for p in group["params"]}
    assert not learned & decayed
    if POSITION_TYPES[name].learned:  # one module per layer, whichever channel it is
        owners = {id(module) for module in model.modules() if getattr(module, "position_type", None) == name}
        assert len(owners) == model.config.n_layer


@pytest.mark.parametrize("name", CASES)
def test_the_export_route_is_the_declared_one_and_keeps_the_logits(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    from ropelab.export.hf import save_hf
    from ropelab.sources.exported import load_export

    model = _model(name)
    if CASES[name][1] == "refused":
        with pytest.raises(ConfigError, match=f"position type '{name}' .* outside ropelab; .* cannot be exported"):
            save_hf(model, tmp_path / "hf")
        assert not (tmp_path / "hf").exists()
        return
    info = save_hf(model, tmp_path / "hf")
    assert info["route"] == CASES[name][1], info.get("why")
    with torch.no_grad():
        ours = model(_ids())[0]
        if info["route"] == "remote_code":
            assert torch.equal(load_export(tmp_path / "hf")(_ids())[0], ours)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
        torch.testing.assert_close(theirs(input_ids=_ids()).logits, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_extrapolation_scales_only_what_declares_it_can(name):
    config = _config(name).model
    cells = plan_cells("run", config, 16, ExtrapolationSettings(lengths=(64,), methods=("yarn",)))
    scaled = [cell for cell in cells if cell.method == "yarn" and cell.model_config is not None]
    takes_scaling = config.positions_for_layer(0)[0].type.extrapolation is None  # asks the rotation's type
    assert rotates(config) == takes_scaling and bool(scaled) == takes_scaling
    if not takes_scaling:  # the report names the method the refusal is about (ALiBi, not the NoPE slot under it)
        assert scaling_refusal(config).startswith(f"{POSITION_TYPES[name].label}: every method is the model itself")
    if not takes_scaling and POSITION_TYPES[name].channel == "rotation" and config.rope.resolve_dims(64):
        with pytest.raises(Exception, match="takes no model.rope.scaling"):
            dataclasses.replace(config, rope=dataclasses.replace(config.rope, scaling=RopeScalingConfig(
                method="yarn", factor=2.0, original_max_position=16))).validate()


def test_a_refusal_names_the_encoding_not_the_empty_rotation_slot_under_it():
    """ALiBi alone rotates nothing (a NoPE slot): the extrapolation report must still say ALiBi."""
    alibi = build_run_config(overrides=["model.position=[{type: alibi}]"]).model
    assert scaling_refusal(alibi) == ("ALiBi: every method is the model itself; ALiBi has no frequency to scale; "
                                      "it runs at any length as it is")
    nope = build_run_config(overrides=["model.position=[{type: nope}]"]).model
    assert scaling_refusal(nope).startswith("NoPE: every method is the model itself")


@pytest.mark.parametrize("name", CASES)
def test_forcing_the_fast_paths_gives_the_reference_rotation(name):
    """The in-place rotation and the kernels rebuild plain cos/sin from the frequencies: a type that
    declares no fast_kernels (FoPE) must take the reference path even when in place is forced."""
    model = _model(name)
    with torch.no_grad():
        for rope in model.ropes:
            rope.inplace = False
        reference = model(_ids())[0]
        for rope in model.ropes:
            rope.inplace = True
        torch.testing.assert_close(model(_ids())[0], reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_the_probes_channel_map_counts_only_turning_pairs(name):
    from ropelab.probe.channels import layer_rope

    model = _model(name)
    for layer, block in enumerate(model.blocks):
        turning = int((block.attn.rope.inv_freq > 0).sum()) if block.attn.rope.rotary_dims else 0
        assert int(layer_rope(model.config, layer).rotated_mask.sum()) == 2 * turning
    if name == "fope":
        assert 0 < turning < model.blocks[0].attn.rope.rotary_dims // 2  # some pairs clipped, some turning


@pytest.mark.parametrize("name", CASES)
def test_the_memory_formula_counts_the_tables_and_kv_cache_the_model_holds(name):
    from ropelab.study.memory import layer_kind_memory

    model, length, cache = _model(name), 40, KVCache()
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, length)), kv_cache=cache)
    (row,) = layer_kind_memory(model.config, length, "fp32")
    assert row["rope_table_bytes"] == sum(rope.cache_bytes() for rope in model.ropes)
    assert row["kv_cache_bytes"] == sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert POSITION_TYPES[name].label in row["position"]


@pytest.mark.parametrize("name", CASES)
def test_a_resumed_run_continues_as_the_uninterrupted_one(name, tmp_path, tiny_overrides):
    """Resuming builds the model on the meta device (`Transformer(init=False)`) and loads the checkpoint."""
    import shutil

    from ropelab.train import checkpoint as ckpt
    from ropelab.train.loop import train
    from ropelab.train.metrics import read_metrics

    overrides = tiny_overrides + [f"model.position={CASES[name][0].replace('trained_length: 16', 'trained_length: 32')}"]
    train(build_run_config(overrides=overrides), tmp_path / "full")
    train(build_run_config(overrides=overrides), tmp_path / "part")
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path / "part") / "step_00000008")
    (tmp_path / "part" / "result.json").unlink()
    train(out_dir=tmp_path / "part", resume=True)
    losses = [[(r["step"], r["loss"]) for r in read_metrics(tmp_path / run)] for run in ("full", "part")]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("name", CASES)
def test_a_pair_plan_converts_only_plain_rope(name):
    from ropelab.config import ConfigError
    from ropelab.sources.plans import check_source

    config = _config(name).model
    rotation = config.positions_for_layer(0)[0].type
    if rotation.fast_kernels and config.rope.resolve_dims(config.head_size) == config.head_size:
        check_source(config, "source")
    else:
        with pytest.raises(ConfigError, match=f"layer 0 (is {rotation.label}|has no RoPE|rotates)"):
            check_source(config, "source")


@pytest.mark.parametrize("name", CASES)
def test_the_long_context_length_guard_asks_the_encoding(name):
    from ropelab.evaluate.longctx import length_limit

    config = _config(name).model
    unbounded = all(any(entry.type.any_length for entry in config.positions_for_layer(layer))
                    for layer in range(config.n_layer))
    assert length_limit(config) == (float("inf") if unbounded else config.max_seq_len)
    assert unbounded == (name == "alibi")


@pytest.mark.parametrize("name", [name for name, kind in POSITION_TYPES.items() if kind.channel == "score_bias"])
def test_a_score_bias_through_flex_gives_the_dense_result(name):
    """flex takes the bias as its score_mod (no (T, T) bias tensor); eager (and slow) on the CPU: one call."""
    from ropelab.attention import attend, flex_available

    if not flex_available():
        pytest.skip("no flex attention in this torch")
    bias = _model(name).blocks[0].attn.score_bias
    q, k, v = torch.randn(2, 4, T, 16), torch.randn(2, 2, T, 16), torch.randn(2, 2, T, 16)
    doc_ids = torch.cat([torch.zeros(2, 10, dtype=torch.long), torch.ones(2, T - 10, dtype=torch.long)], 1)
    dense = attend(q, k, v, doc_ids, "dense", score_bias=bias)
    torch.testing.assert_close(attend(q, k, v, doc_ids, "flex", score_bias=bias), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [name for name, kind in POSITION_TYPES.items() if kind.channel == "score_bias"])
def test_a_score_bias_model_gives_the_dense_logits_on_every_backend_and_decoding(name):
    """Documents, a sliding layer and a chunked one: varlen and the local kernel form the bias themselves;
    a KV-cached decode gets the full forward's logits."""
    config = _config(name, "model.layer_pattern=SC",
                     "model.layer_kinds={S: {attention: sliding, window: 5}, C: {attention: chunked, window: 7}}")
    torch.manual_seed(0)
    model = Transformer(config.model).eval()
    doc_ids = torch.cat([torch.zeros(2, 9, dtype=torch.long), torch.ones(2, T - 9, dtype=torch.long)], 1)
    logits = {}
    with torch.no_grad():
        for backend in ("dense", "varlen", "local", "auto"):
            model.set_attention_backend(backend)
            logits[backend] = model(_ids(), doc_ids=doc_ids)[0]
    for backend in ("varlen", "local", "auto"):
        torch.testing.assert_close(logits[backend], logits["dense"], atol=2e-5, rtol=1e-5, msg=backend)
    cache, pieces = KVCache(), []  # the windowed layers' cache drops keys: the bias over the keys it holds
    with torch.no_grad():
        for start, end in ((0, 11), (11, 12), (12, 20), (20, T)):
            pieces.append(model(_ids()[:, start:end], doc_ids=doc_ids[:, :end], kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(pieces, 1), logits["dense"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [name for name, kind in POSITION_TYPES.items() if kind.channel == "score_bias"])
def test_a_score_bias_counts_chunks_from_a_left_padded_rows_first_token(name):
    """A left-padded row (Documents.chunk_start) gives its real tokens what the row alone gives them."""
    from ropelab.attention import Documents, attend

    bias = _model(name).blocks[0].attn.score_bias
    pad, length, window = 3, 13, ("chunked", 4)
    tokens = pad + length
    q, k, v = torch.randn(1, 4, tokens, 16), torch.randn(1, 2, tokens, 16), torch.randn(1, 2, tokens, 16)
    doc_ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, length, dtype=torch.long)], 1)
    alone = attend(q[:, :, pad:], k[:, :, pad:], v[:, :, pad:], None, "dense", window, score_bias=bias)
    for backend in ("dense", "varlen", "local"):
        padded = attend(q, k, v, Documents(doc_ids, chunk_start=torch.tensor([pad])), backend, window, score_bias=bias)
        torch.testing.assert_close(padded[:, :, pad:], alone, atol=1e-6, rtol=1e-5, msg=backend)


def test_layer_kinds_mix_encodings_in_one_model():
    config = build_run_config(overrides=[
        f"model.vocab_size={VOCAB}", "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2",
        "model.layer_pattern=FA",
        "model.layer_kinds={F: {position: [{type: fope, trained_length: 16}]}, A: {position: [{type: alibi}]}}"]).model
    torch.manual_seed(0)
    model = Transformer(config).eval()
    first, second = model.blocks[0].attn, model.blocks[1].attn
    assert first.rope.position_type == "fope" and first.score_bias is None
    assert second.rope.rotary_dims == 0 and second.score_bias is not None
    ids, cache = _ids(), KVCache()
    with torch.no_grad():
        full = model(ids)[0]
        pieces = [model(ids[:, :11], kv_cache=cache)[0], model(ids[:, 11:], kv_cache=cache)[0]]
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "dense", "varlen", "local"])
def test_a_whole_attention_override_replaces_attention_on_every_backend(backend):
    """A layer whose list has an `attention` entry calls that module instead of ropelab's attention: at
    temperature 1 it computes what a plain RoPE model does (whatever backend is asked for, documents and
    windows included), at another temperature something else."""
    windows = ("model.layer_pattern=LS", "model.layer_kinds={L: {attention: full}, S: {attention: sliding, window: 5}}")
    plain = Transformer(_config("rope", *windows).model).eval()
    outputs = {}
    for temperature in (1.0, 1.5):
        override = f"{{type: {temperature_attention.NAME}, temperature: {temperature}}}"
        position = f"model.position=[{{type: rope}}, {override}]"
        model = Transformer(_config("rope", *windows, position).model).eval()
        model.load_state_dict(plain.state_dict(), strict=False)  # every weight but the temperatures
        model.set_attention_backend(backend)
        doc_ids = torch.cat([torch.zeros(2, 9, dtype=torch.long), torch.ones(2, T - 9, dtype=torch.long)], 1)
        with torch.no_grad():
            outputs[temperature] = model(_ids(), doc_ids=doc_ids)[0]
    plain.set_attention_backend(backend)
    with torch.no_grad():
        expected = plain(_ids(), doc_ids=doc_ids)[0]
    torch.testing.assert_close(outputs[1.0], expected, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(outputs[1.5], expected, atol=1e-3)
