import pytest
import torch

from ropelab.config import ModelConfig, RopeConfig
from ropelab.model import Transformer
from ropelab.study.memory import cache_bytes, memory_table, rotary_dims_for


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
