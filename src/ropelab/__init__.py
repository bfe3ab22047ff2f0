"""ropelab: train, distill, evaluate and dissect rotary position embeddings (RoPE).

``ropelab.load(source)`` -> (model, tokenizer, config) for a run, a checkpoint, an imported folder,
a Hugging Face folder or hub name, or a GGUF file (see `ropelab.sources`).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `load` is resolved on first use so that `import ropelab.config` does not import torch
    if name == "load":
        from ropelab.sources import load

        return load
    raise AttributeError(f"module 'ropelab' has no attribute {name!r}")
