"""Attention with an additive score bias (the `score_bias` channel of `ropelab.config.position`:
ALiBi): softmax(q k^T / sqrt(D) + bias + mask) v, the bias from the token indices of queries and keys.

  attend_with_bias(q, k, v, doc_ids, window, key_start, bias)

Where `ropelab.attention.resolve_backend` picks ``flex`` (CUDA with document ids, or asked for) and no
cache splits the queries from the keys, the bias is flex attention's `score_mod` over its block mask:
no (T, T) tensor. Every other case is SDPA with a float mask, the (H, Tq, Tk) bias with -inf where the
causal, document and window mask (`ropelab.attention`) hides a key, which materialises the bias per
head as the dense backend materialises its mask; the varlen and local kernels take no bias yet. With a
key/value cache the queries are the last Tq tokens and the keys the cache holds from token
`key_start` on, as in `ropelab.attention.attend`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ropelab.attention import Documents, _flex, document_mask, resolve_backend
from ropelab.attention_windows import Window, check_window, sdpa, window_mask


def attend_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     doc_ids: Optional[Union[torch.Tensor, Documents]], window: Window, key_start: int,
                     bias, backend: str = "auto") -> torch.Tensor:
    """q (B, Hq, Tq, D), k/v (B, Hk, T, D), doc_ids (B, key_start + T) or None; `bias` a module whose
    ``bias(query_index, key_index)`` is (Hq, Tq, T) and ``score_mod()`` flex's -> (B, Hq, Tq, D)."""
    Tq, T = q.shape[2], k.shape[2]
    tokens = key_start + T
    window = check_window(window, tokens)
    if Tq == T and not key_start and resolve_backend(backend, doc_ids, q.device, window, T) == "flex":
        return _flex_with_bias(q, k, v, doc_ids, window, bias)
    start = doc_ids.chunk_start if isinstance(doc_ids, Documents) else None  # a left-padded row's chunks
    visible = window_mask(Tq, tokens, window, q.device, key_start, start)  # (Tq, T), or (B, 1, Tq, T) given start
    ids = doc_ids.doc_ids if isinstance(doc_ids, Documents) else doc_ids
    if ids is not None:
        visible = document_mask(ids, Tq)[..., key_start:] & visible  # (B, 1, Tq, T)
    query_index = torch.arange(tokens - Tq, tokens, device=q.device)
    scores_bias = bias.bias(query_index, torch.arange(key_start, tokens, device=q.device))  # (Hq, Tq, T)
    mask = scores_bias.masked_fill(~visible, float("-inf")).to(q.dtype)
    return sdpa(q, k, v, mask, False)


def _flex_with_bias(q, k, v, doc_ids, window: Window, bias) -> torch.Tensor:
    if not isinstance(doc_ids, Documents):  # one document per row where none are given
        doc_ids = Documents(torch.zeros(q.shape[0], q.shape[2], dtype=torch.long, device=q.device)
                            if doc_ids is None else doc_ids)
    return _flex(q, k, v, doc_ids, window, bias.score_mod())  # compiled on CUDA: a fused kernel


__all__ = ["attend_with_bias"]
