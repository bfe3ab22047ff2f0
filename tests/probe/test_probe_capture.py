import pytest
import torch
from safetensors import safe_open

from ropelab.data.tokenizer import ByteTokenizer
from ropelab.probe.analysis import read_captures
from ropelab.probe.capture import SafetensorsStream, capture
from ropelab.probe.config import STAGES, ProbeMode
from ropelab.probe.sequence import build_probe_input
from ropelab.rope import apply_partial_rope, rope_angles

from probe_helpers import tiny_model

BLOCK, REPEATS = 24, 5


def _probe():
    content = list(range(65, 65 + BLOCK - 2))
    return build_probe_input(ByteTokenizer(), content, BLOCK, REPEATS, "test")


def _capture(model, mode, path, layers=(0, 1), stages=STAGES):
    with SafetensorsStream(path) as stream:
        capture(model, _probe(), mode, layers, stages, stream)
        stream.finish({"mode": mode.name})
    return dict(read_captures(path))


def _per_layer_rope_model():
    # layer 1 rotates every channel at another theta: two RotaryEmbedding modules, one per layer
    return tiny_model(0, "model.rope_layers={1: {fraction: 1.0, theta: 50.0}}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_document_mask_and_restarting_positions_make_every_repeat_identical(tmp_path, precision):
    model = _per_layer_rope_model().to(torch.bfloat16 if precision == "bf16" else torch.float32)
    captures = _capture(model, ProbeMode("doc", precision, "restart"), tmp_path / "c.safetensors")
    assert sorted(captures) == sorted(["embed", "final", "logits"] + [f"{s}.{i}" for s in ("q_pre", "k_pre", "q_post", "k_post", "block") for i in (0, 1)])
    for name, x in captures.items():
        assert x.shape[0] == REPEATS
        if precision == "fp32":
            tolerance = {"atol": 1e-6, "rtol": 0}
        else:  # equal in exact arithmetic, summed in another order: bf16 (8 significant bits) may round them a
            # step apart (2^-7 relative at most); two steps, of the largest value for results near zero
            tolerance = {"rtol": 2**-6, "atol": 2**-7 * x.float().abs().max().item()}
        torch.testing.assert_close(x, x[:1].expand_as(x), **tolerance, msg=lambda m: f"{name}: {m}")


def test_causal_running_repeats_differ(tmp_path):
    captures = _capture(_per_layer_rope_model(), ProbeMode("causal", "fp32", "running"), tmp_path / "c.safetensors")
    for name in ("block.1", "final", "logits", "q_post.0", "k_pre.1"):
        x = captures[name]
        assert (x[1:] - x[0]).abs().max() > 1e-4, name
    assert torch.equal(captures["embed"], captures["embed"][:1].expand_as(captures["embed"]))  # same tokens


def test_captures_match_the_models_own_forward(tmp_path):
    model = _per_layer_rope_model()
    probe = _probe()
    captures = _capture(model, ProbeMode("causal", "fp32", "running"), tmp_path / "c.safetensors")
    rows = probe.analysis_positions()
    ids = probe.input_ids().unsqueeze(0)
    with torch.no_grad():
        logits, _ = model(ids)
        hidden = model.hidden_states(ids)
    torch.testing.assert_close(captures["logits"], logits[0, rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(captures["final"], hidden[0, rows])
    torch.testing.assert_close(captures["embed"], model.embed.weight[ids[0, rows]])
    for layer in (0, 1):  # post-RoPE = the layer's own rotation of the pre-RoPE capture at the analysed positions
        rope = model.blocks[layer].attn.rope
        cos, sin = rope_angles(rows, rope.inv_freq)
        for stage in ("q", "k"):
            pre = captures[f"{stage}_pre.{layer}"].transpose(0, 1)  # (heads, R, D)
            expected = apply_partial_rope(pre, cos, sin, rope.rotary_dims, rope.layout).transpose(0, 1)
            torch.testing.assert_close(captures[f"{stage}_post.{layer}"], expected, atol=1e-6, rtol=1e-5)
    assert captures["q_pre.0"].shape == (REPEATS, 2, 16) and captures["k_pre.0"].shape == (REPEATS, 1, 16)


def test_only_the_chosen_layers_and_stages(tmp_path):
    captures = _capture(tiny_model(0), ProbeMode(), tmp_path / "c.safetensors", layers=(1,), stages=("q_post", "logits"))
    assert sorted(captures) == ["logits", "q_post.1"]


def test_stream_writes_a_safetensors_file_and_aborts_cleanly(tmp_path):
    path = tmp_path / "s.safetensors"
    with SafetensorsStream(path) as stream:
        stream.add("a", torch.arange(6.0).view(2, 3))
        stream.add("b", torch.tensor([1.5], dtype=torch.bfloat16))
        stream.finish({"note": "x"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"note": "x"}
        assert torch.equal(f.get_tensor("a"), torch.arange(6.0).view(2, 3))
        assert f.get_tensor("b").tolist() == [1.5] and f.get_tensor("b").dtype == torch.float32
    with pytest.raises(RuntimeError):
        with SafetensorsStream(tmp_path / "t.safetensors") as stream:
            stream.add("a", torch.ones(2))
            raise RuntimeError("model failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]
