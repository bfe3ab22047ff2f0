"""ropelab: train, distill, evaluate and dissect rotary position embeddings (RoPE)."""

__version__ = "0.1.0"
