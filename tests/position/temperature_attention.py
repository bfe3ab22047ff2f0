"""A test-only position encoding of the `attention` channel: the proof that a method replacing attention
itself runs on every path. It computes its own softmax, with a learned temperature per head:

    softmax(q k^T / (sqrt(D) * t_h) + score bias) v,   t_h = exp(log_temperature_h)

over the keys `ropelab.attention.visible_keys` lets each query see (causal, documents, window, a KV
cache's held keys), so it is also an independent check of the kernels' masks. `registered()` adds it to
the registries for the time of a `with` block only: no shipped path knows it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ropelab.attention import Documents, visible_keys
from ropelab.attention_bias import biased_mask, distances
from ropelab.attention_windows import check_window
from ropelab.config.checks import check_float
from ropelab.config.position import POSITION_TYPES, PositionType, register_position
from ropelab.position.registry import ATTENTIONS

NAME = "test_temperature"


@dataclass
class TemperatureSpec:
    temperature: float = 1.5

    def validate(self, key: str, head_dim: int, n_head: int) -> None:
        check_float(f"{key}.temperature", self.temperature, "(0, 100]")


class TemperatureAttention(nn.Module):
    position_type = NAME

    def __init__(self, spec: TemperatureSpec, n_head: int):
        super().__init__()
        self.log_temperature = nn.Parameter(torch.full((n_head,), math.log(spec.temperature)))

    def forward(self, q, k, v, doc_ids=None, backend="auto", window=None, key_start=0, score_bias=None):
        """`ropelab.attention.attend`'s arguments -> (B, H, Tq, D); every backend is this one."""
        Tq, T, D = q.shape[2], k.shape[2], q.shape[3]
        tokens = key_start + T
        window = check_window(window, tokens)
        start = doc_ids.chunk_start if isinstance(doc_ids, Documents) else None
        ids = doc_ids.doc_ids if isinstance(doc_ids, Documents) else doc_ids
        first, mask = visible_keys(ids, window, Tq, tokens, key_start, q.device, start)
        k, v = k[:, :, first - key_start:], v[:, :, first - key_start:]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scale = 1 / (math.sqrt(D) * self.log_temperature.exp()).view(-1, 1, 1)  # (H, 1, 1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, Tq, keys)
        if score_bias is None:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + biased_mask(mask, score_bias, distances(Tq, tokens - first, q.device, tokens - Tq, first),
                                          torch.float32)
        return (scores.softmax(-1) @ v.float()).to(q.dtype)


TYPE = PositionType(NAME, "Temperature", TemperatureSpec, "attention", "test only: softmax with a learned temperature",
                    learned=True)  # its KV cache: keys and values, the default KVState


@contextlib.contextmanager
def registered():
    """The method registered (its type and its module) inside the block, removed after it."""
    register_position(TYPE)
    ATTENTIONS[NAME] = TemperatureAttention
    try:
        yield TYPE
    finally:
        del POSITION_TYPES[NAME], ATTENTIONS[NAME]
