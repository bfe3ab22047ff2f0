"""Attention with an additive score bias (the `score_bias` channel of `ropelab.config.position`:
ALiBi): softmax(q k^T / sqrt(D) + bias + mask) v, the bias from the token indices of queries and keys.

  attend_with_bias(q, k, v, doc_ids, window, key_start, bias)

Every backend takes this one path: SDPA with a float mask, the (H, Tq, Tk) bias with -inf where the
causal, document and window mask (`ropelab.attention`) hides a key. That materialises the bias per
head, as the dense backend materialises its mask; flex's score_mod and the varlen and local kernels,
which would not, take no bias yet. With a key/value cache the queries are the last Tq tokens and the
keys the cache holds from token `key_start` on, as in `ropelab.attention.attend`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ropelab.attention import Documents, document_mask
from ropelab.attention_windows import Window, check_window, sdpa, window_mask


def attend_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     doc_ids: Optional[Union[torch.Tensor, Documents]], window: Window, key_start: int,
                     bias) -> torch.Tensor:
    """q (B, Hq, Tq, D), k/v (B, Hk, T, D), doc_ids (B, key_start + T) or None; `bias` a module whose
    ``bias(query_index, key_index)`` is (Hq, Tq, T) -> (B, Hq, Tq, D)."""
    Tq, T = q.shape[2], k.shape[2]
    tokens = key_start + T
    window = check_window(window, tokens)
    visible = window_mask(Tq, tokens, window, q.device, key_start)  # (Tq, T)
    ids = doc_ids.doc_ids if isinstance(doc_ids, Documents) else doc_ids
    if ids is not None:
        visible = document_mask(ids, Tq)[..., key_start:] & visible  # (B, 1, Tq, T)
    query_index = torch.arange(tokens - Tq, tokens, device=q.device)
    scores_bias = bias.bias(query_index, torch.arange(key_start, tokens, device=q.device))  # (Hq, Tq, T)
    mask = scores_bias.masked_fill(~visible, float("-inf")).to(q.dtype)
    return sdpa(q, k, v, mask, False)


__all__ = ["attend_with_bias"]
