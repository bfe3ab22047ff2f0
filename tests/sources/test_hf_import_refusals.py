"""Import refuses, in one line, what ropelab's model would drop: a rope parameter it does not read (a
position setting of another method) and a weight it has no place for (a learned position encoding)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelab.config import ConfigError  # noqa: E402
from ropelab.sources.hf import from_hf  # noqa: E402
from ropelab.sources.hf_config_read import model_config_from_hf  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
             max_position_embeddings=64)


def _llama(**rope) -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500.0, **rope})


def test_the_rope_parameters_ropelab_reads_import():
    assert model_config_from_hf(_llama()).rope.theta == 500.0


@pytest.mark.parametrize("extra", [{"alibi_max_bias": 8.0}, {"fope_trained_length": 256}, {"low_freq_factor": 1.0}])
def test_an_unread_rope_parameter_is_refused_naming_it(extra):
    with pytest.raises(ConfigError) as raised:
        model_config_from_hf(_llama(**extra))
    assert f"rope parameter {next(iter(extra))!r}" in str(raised.value) and "\n" not in str(raised.value)


def test_a_weight_without_a_place_in_ropelab_is_refused_naming_it():
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(_llama()).eval()
    from_hf(hf_model)  # every weight has its place
    hf_model.model.layers[0].self_attn.register_parameter("fourier_coefficients", torch.nn.Parameter(torch.eye(8)))
    with pytest.raises(ConfigError, match="weight model.layers.0.self_attn.fourier_coefficients has no place"):
        from_hf(hf_model)
