"""The context a model is evaluated in by default: the one its weights were trained at.

Shared by the evaluations (`longctx`, `extrapolation`, the lm-eval model "ropelab") and by the Hugging
Face export, which writes it where lm-eval's HF backend reads a model's context (`ropelab.export.hf`).
"""

from __future__ import annotations

from ropelab import sources
from ropelab.sources.runs import IMPORT


def trained_length(source: sources.Source, config) -> int:
    """The context the weights were trained at: data.seq_len for a ropelab run; for a model made
    elsewhere (HF, GGUF, or a folder of `ropelab import`, whose data.seq_len is only a placeholder) its
    own context, model.max_seq_len."""
    imported = not source.is_ropelab or (source.run_dir is not None and (source.run_dir / IMPORT).is_file())
    return config.model.max_seq_len if imported else config.data.seq_len


__all__ = ["trained_length"]
