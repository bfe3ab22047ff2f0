"""Attention kernels over already-rotated queries and keys.

Backends:
  * ``sdpa``  – PyTorch scaled_dot_product_attention, causal, no document mask;
  * ``dense`` – SDPA with a dense boolean (T x T) mask built from document ids (reference);
  * ``varlen`` – each document attends only to itself, computed document by document, so
    cost grows with the sum of squared document lengths, not the window length squared.
``auto`` picks ``sdpa`` without a document mask and ``varlen`` with one.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) boolean mask: causal and within one document."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


def _sdpa(q, k, v, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _varlen(q, k, v, doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within each run of equal document ids, one sequence at a time."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        ids = doc_ids[b]
        change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
        bounds = [0, *change.tolist(), ids.shape[0]]
        for start, end in zip(bounds[:-1], bounds[1:]):
            out[b : b + 1, :, start:end] = _sdpa(
                q[b : b + 1, :, start:end], k[b : b + 1, :, start:end], v[b : b + 1, :, start:end], None, True
            )
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """q (B, Hq, T, D), k/v (B, Hk, T, D), optional doc_ids (B, T) -> (B, Hq, T, D)."""
    if doc_ids is None or backend == "sdpa":
        return _sdpa(q, k, v, None, True)
    if backend == "dense":
        return _sdpa(q, k, v, document_mask(doc_ids), False)
    return _varlen(q, k, v, doc_ids)
