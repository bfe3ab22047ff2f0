"""A score bias as an SDPA float mask: the `score_bias` channel of `ropelab.config.position` (ALiBi).

A score bias is a module with

  bias(distance)   distance (...) int tensor, query token index - key token index -> (H, ...) float32,
                   the term added to each head's scores
  score_mod()      the same term as flex attention's score_mod (no (T, T) tensor is formed), built
                   once per module

It depends on the distance only (ALiBi, and relative biases generally), so a backend forms it for
the index ranges it attends over: the dense and SDPA backends (Tq, Tk), the varlen kernel once per
group of equal-length documents (L, L), the local kernel once per block's key span. A method that
needs absolute positions is a whole-attention override (`ropelab.position.ATTENTIONS`).
"""

from __future__ import annotations

import torch


def distances(queries: int, keys: int, device: torch.device, first_query: int = 0, first_key: int = 0) -> torch.Tensor:
    """(queries, keys) query token index - key token index, for queries from token `first_query` and keys
    from `first_key`."""
    query_index = torch.arange(first_query, first_query + queries, device=device)
    return query_index.unsqueeze(1) - torch.arange(first_key, first_key + keys, device=device)


def biased_mask(visible: torch.Tensor, score_bias, distance: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's float mask: the bias (H, ...) from `distance`, -inf where `visible` (broadcasting against
    (H, ...) from the left, e.g. (B, 1, Tq, Tk)) hides a key."""
    return torch.where(visible, score_bias.bias(distance), float("-inf")).to(dtype)


__all__ = ["biased_mask", "distances"]
