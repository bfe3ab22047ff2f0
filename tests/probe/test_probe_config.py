import pytest

from ropelab.config import ConfigError
from ropelab.probe.config import ALL_MODES, ProbeConfig, ProbeMode, parse_layers, parse_mode, parse_modes, parse_stages


def test_modes_default_to_the_seeds_setting_per_axis():
    assert parse_mode("doc-restart") == ProbeMode("doc", "fp32", "restart")
    assert parse_mode("bf16") == ProbeMode("causal", "bf16", "running")
    assert parse_mode("restart-bf16-doc").name == "doc-bf16-restart"
    assert parse_modes("all") == ALL_MODES and len(set(ALL_MODES)) == 8
    assert parse_modes("bf16, causal-bf16-running,doc") == (ProbeMode(precision="bf16"), ProbeMode(attention="doc"))


@pytest.mark.parametrize("text, message", [("doc-causal", "attention twice"), ("fp16", "unknown word 'fp16'"), (",", "empty")])
def test_bad_modes(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_modes(text)


def test_layers_and_stages():
    assert parse_layers("all") is None
    assert ProbeConfig(layers=parse_layers("0,-1,-1")).layer_indices(4) == (0, 3)
    with pytest.raises(ConfigError, match="layer 4 out of range"):
        ProbeConfig(layers=(4,)).layer_indices(4)
    with pytest.raises(ConfigError, match="--layers"):
        parse_layers("first")
    assert parse_stages("logits,embed") == ("embed", "logits")
    with pytest.raises(ConfigError, match="unknown stage 'attn'"):
        parse_stages("attn")


@pytest.mark.parametrize("kwargs, message", [
    ({"block_len": 2}, "--block-len=2"), ({"repeats": 1}, "--repeats=1"), ({"modes": ()}, "--modes"),
    ({"modes": (ProbeMode(precision="fp16"),)}, "precision must be one of"), ({"top_spans": 0}, "--top=0"),
])
def test_validate(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ProbeConfig(**kwargs).validate()
    assert ProbeConfig().validate().window == 2048 * 64  # the seed's 128k window
