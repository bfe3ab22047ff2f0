"""transformers as an optional dependency (``ropelab[hf]``): imported when a function needs it, with
one line saying how to install it, and the dtype keyword its version spells."""

from __future__ import annotations

import torch

from ropelab.config import ConfigError

INSTALL = "pip install 'ropelab[hf]'"  # transformers, and gguf + accelerate for GGUF files


def require_transformers(purpose: str):
    """The transformers module, or a one-line ConfigError: "`purpose` needs transformers: ..."."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{purpose} needs transformers: {INSTALL}") from None
    return transformers


def dtype_kwargs(transformers, dtype: torch.dtype) -> dict:
    """`from_pretrained`'s dtype keyword: `dtype` from transformers 4.56 on, `torch_dtype` before."""
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}
