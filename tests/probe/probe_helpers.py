"""Tiny models and run folders for the probe tests (written with `save_weights_only`, no training)."""

import torch

from ropelab.config import ModelConfig, RopeConfig, build_run_config
from ropelab.sources.imported import save_weights_only
from ropelab.model import Transformer

# head_dim 16, half of it rotated: queries and keys have rotated and unrotated channels.
PROBE_TINY = [
    "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.n_kv_head=1", "model.d_ff=64",
    "model.vocab_size=320", "model.rope.fraction=0.5", "data.tokenizer=bytes", "data.seq_len=32",
]


def tiny_config(*overrides):
    return build_run_config(overrides=[*PROBE_TINY, *overrides])


def tiny_model(seed=0, *overrides):
    torch.manual_seed(seed)
    return Transformer(tiny_config(*overrides).model).eval()


def write_run(run_dir, model, config, step=5):
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    save_weights_only(run_dir, step, model, config)
    return run_dir


def plan_source(layout="half", seed=0):
    """A full-RoPE model (head_dim 8: 4 pairs; 4 query heads over 2 KV heads) to convert to a plan,
    its weights moved far from their init so that every row differs."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                         rope=RopeConfig(theta=100.0, layout=layout))
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model
