"""ALiBi (Press et al. 2022, "Train Short, Test Long"): no rotation; head h adds
-slope_h * (query index - key index) to its attention scores, slope_h = 2^(-max_bias * (h + 1) / H)
(`ropelab.config.position.AlibiSpec`).

The bias depends on token indices only (in a document, their difference equals the difference of
position ids), so a KV cache holds plain keys and values, and the scores of a cached decode equal a
full forward's. The slopes are a non-persistent buffer: `rebuild_after_meta` computes them again after the model
was built on the meta device (`Transformer(init=False)`, every load path and resume), where they
would otherwise be uninitialised memory.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ropelab.config.position import AlibiSpec


class Alibi(nn.Module):
    position_type = "alibi"

    def __init__(self, spec: AlibiSpec, n_head: int):
        super().__init__()
        self.spec, self.n_head = spec, n_head
        self.register_buffer("slopes", self._slopes(None), persistent=False)  # (H,)
        self._score_mod: Optional[tuple[torch.Tensor, Callable]] = None  # (the slopes it was built for, score_mod)

    def _slopes(self, device: Optional[torch.device]) -> torch.Tensor:
        heads = torch.arange(1, self.n_head + 1, dtype=torch.float32, device=device)
        return torch.exp2(-self.spec.max_bias * heads / self.n_head)

    def rebuild_after_meta(self) -> None:
        """The slopes again where they are (after `to_empty`, in uninitialised memory), or on the default
        device where they are still on the meta device (transformers' from_pretrained)."""
        self.slopes = self._slopes(None if self.slopes.is_meta else self.slopes.device).to(self.slopes.dtype)

    def bias(self, distance: torch.Tensor) -> torch.Tensor:
        """Query token index - key token index (...) -> the score bias (H, ...), float32."""
        return -self.slopes.float().view(-1, *[1] * distance.dim()) * distance

    def score_mod(self):
        """The bias as flex attention's score_mod (no (T, T) tensor is formed), built once for the slopes
        tensor the module holds: `.to()` and `rebuild_after_meta` give it a new one, and so a new score_mod.
        (A new closure per call would not recompile compiled flex either: one graph over three calls,
        torch 2.13 on the CPU.)"""
        if self._score_mod is None or self._score_mod[0] is not self.slopes:
            slopes = self.slopes.float()

            def alibi(score, batch, head, query_index, key_index):
                return score - slopes[head] * (query_index - key_index)

            self._score_mod = (self.slopes, alibi)
        return self._score_mod[1]

    def extra_repr(self) -> str:
        return f"heads={self.n_head}, max_bias={self.spec.max_bias:g}"
