"""Per-layer position lists (`model.position_layers`): every build path asks `positions_for_layer(layer)`,
not layer 0's list: the model's modules, meta-device loading, KV-cached decoding, export and the probe."""

from __future__ import annotations

import pytest
import torch

from ropelab.config import build_run_config
from ropelab.kv_cache import KVCache
from ropelab.model import Transformer
from ropelab.position.alibi import Alibi
from ropelab.position.fope import FourierEmbedding

VOCAB, T = 64, 20
MIXED = "model.position_layers={1: [{type: fope, trained_length: 16}], 2: [{type: rope, fraction: 0.25}, {type: alibi}]}"


def _model(*overrides: str) -> Transformer:
    torch.manual_seed(0)
    config = build_run_config(overrides=[f"model.vocab_size={VOCAB}", "model.n_layer=3", "model.d_model=64",
                                         "model.n_head=4", "model.n_kv_head=2", *overrides]).model
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def mixed() -> Transformer:
    return _model(MIXED)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))


def test_each_layer_gets_the_modules_of_its_own_list(mixed):
    rotations = [block.attn.rope for block in mixed.blocks]
    assert [type(rope).__name__ for rope in rotations] == ["RotaryEmbedding", "FourierEmbedding", "RotaryEmbedding"]
    assert isinstance(rotations[1], FourierEmbedding) and [r.rotary_dims for r in rotations] == [16, 16, 4]
    assert [type(block.attn.score_bias) for block in mixed.blocks] == [type(None), type(None), Alibi]


def test_built_on_the_meta_device_and_loaded_it_computes_the_same(mixed):
    loaded = Transformer(mixed.config, init=False)
    loaded.load_state_dict(mixed.state_dict())
    with torch.no_grad():
        assert torch.equal(mixed(_ids())[0], loaded(_ids())[0])


def test_kv_cached_decoding_gives_the_full_forwards_logits(mixed):
    cache, pieces, start = KVCache(), [], 0
    with torch.no_grad():
        full = mixed(_ids())[0]
        for end in (7, 8, T):
            pieces.append(mixed(_ids()[:, start:end], kv_cache=cache)[0])
            start = end
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-5)


def test_the_export_ships_ropelabs_code_naming_the_layers_encodings_and_keeps_the_logits(mixed, tmp_path):
    pytest.importorskip("transformers")
    from ropelab.export.hf import save_hf
    from ropelab.sources.exported import load_export

    info = save_hf(mixed, tmp_path / "hf")
    assert info["route"] == "remote_code" and "alibi, fope" in info["why"], info.get("why")
    with torch.no_grad():
        assert torch.equal(load_export(tmp_path / "hf")(_ids())[0], mixed(_ids())[0])


def test_a_layer_list_an_hf_class_computes_exports_natively(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ropelab.export.hf import save_hf

    model = _model("model.position_layers={1: [{type: nope}]}")
    info = save_hf(model, tmp_path / "hf")
    assert info["route"] == "native", info.get("why")
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(input_ids=_ids()).logits
        torch.testing.assert_close(theirs, model(_ids())[0], atol=1e-4, rtol=1e-4)


def test_the_probes_channel_map_follows_each_layers_rotation(mixed):
    from ropelab.probe.channels import layer_rope

    for layer, block in enumerate(mixed.blocks):
        turning = int((block.attn.rope.inv_freq > 0).sum())
        assert int(layer_rope(mixed.config, layer).rotated_mask.sum()) == 2 * turning
    assert int(layer_rope(mixed.config, 2).rotated_mask.sum()) == 4  # a quarter of 16 channels
