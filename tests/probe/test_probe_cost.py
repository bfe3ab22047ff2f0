from ropelab.config import ModelConfig
from ropelab.probe.cost import memory_estimate


def test_memory_estimate_hand_computed():
    # C 8, F 16, 2 heads and 1 kv head of 4 channels, 3 layers, vocab 10; window 100, 5 repeats, bf16
    config = ModelConfig(n_layer=3, d_model=8, n_head=2, n_kv_head=1, d_ff=16, vocab_size=10)
    out = memory_estimate(config, params=1000, window=100, repeats=5, precision="bf16")
    assert out["weights"] == 2000
    assert out["forward_layer"] == 100 * (32 + 48 + 32 + 16) * 2  # 4C + 3F + 4HD + 4KD
    assert out["capture_streaming"] == 5 * (3 * (16 + 8 + 8) + 16 + 10) * 4
    assert out["capture_everything"] == 100 * (3 * 32 + 16) * 2 + 100 * 10 * 4
    assert out["peak"] == out["weights"] + out["forward_layer"] + out["capture_streaming"]
    assert memory_estimate(config, 1000, 100, 5, "fp32")["forward_layer"] == 2 * out["forward_layer"]
