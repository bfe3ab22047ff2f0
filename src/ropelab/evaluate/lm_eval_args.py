"""The harness's model_args for the lm-eval model "ropelab" (`ropelab.evaluate.lm_eval_model`), read
into Python values: each arrives as a string from ``--model_args`` or as a value from Python, and a
wrong one is a one-line ConfigError naming it."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ropelab.config import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_int(value: Any, key: str) -> Optional[int]:
    """`value` as an integer; None when it is unset or empty."""
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"model_args {key}={value!r}: expected an integer") from None


def parse_batch_size(value: Any) -> int:
    """A batch size >= 1; 8 when unset, and for the harness's ``auto`` (no automatic sizing here)."""
    if value is None:
        return 8
    text = str(value)
    if text.startswith("auto"):
        log.warning("ropelab: batch_size=%s: no automatic batch sizing, using 8", text)
        return 8
    size = parse_int(text, "batch_size")
    if size is None or size < 1:
        raise ConfigError(f"model_args batch_size={value!r}: must be >= 1")
    return size


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """A `DTYPES` name, or ``auto``: bfloat16 on a CUDA device that supports it, else float32."""
    if name == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"model_args dtype={name!r}: choose float32, bfloat16, float16 or auto")
    return DTYPES[name]


__all__ = ["DTYPES", "parse_int", "parse_batch_size", "parse_dtype"]
