"""Attention windows: which earlier tokens a query sees, and a blocked kernel whose cost follows the window.

A window is ``None`` (full causal attention), ``("sliding", W)`` or ``("chunked", C)``, over token
indices within a row (not position ids), as HF transformers' masking utilities define them:
  * sliding: query i sees key j iff j <= i and i - j < W (itself and the W - 1 tokens before it);
  * chunked: query i sees key j iff j <= i and (i - s) // C == (j - s) // C (the earlier tokens of its
    own chunk), where the row's chunks begin at token index s: 0, or the row's left padding in a
    left-padded batch, as transformers counts chunks there (`window_mask`'s `start`).

`local_attention` splits the queries into blocks and attends each block only to the keys its queries
may see, one batched SDPA call over all blocks: for a sliding window a block of b queries reads its
own keys and those of the ceil((W - 1) / b) blocks before it (copied side by side once; a small mask
per block trims the span to the window and hides the zero keys standing in before the row), so the
cost grows with T * (b + W) instead of T^2; for a chunked window a block is a chunk, attended
causally on its own (where a row's chunks begin at its own start, a block of C also reads the block
before it, and its mask keeps each query's chunk). The last block is padded with zero tokens after
the row's end, which causality keeps out of every real query's view.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from ropelab.attention_bias import biased_mask

WINDOW_KINDS = ("sliding", "chunked")
Window = Optional[tuple[str, int]]


def sdpa(q, k, v, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
    """scaled_dot_product_attention, grouping query heads when there are fewer key/value heads."""
    if k.shape[1] != q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def check_window(window, keys: int) -> Window:
    """`window` as a (kind, size) tuple, or None when it hides none of `keys` keys (size >= keys)."""
    if window is None:
        return None
    kind, size = window if isinstance(window, (tuple, list)) and len(window) == 2 else (None, None)
    if kind not in WINDOW_KINDS or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"attention window {window!r}: None, ('sliding', W) or ('chunked', C) with an int size >= 1")
    return None if size >= keys else (kind, size)


def visible(query_idx: torch.Tensor, key_idx: torch.Tensor, window: Window) -> torch.Tensor:
    """Whether the query at token index `query_idx` sees the key at `key_idx` (broadcasting integer tensors)."""
    seen = key_idx <= query_idx
    if window is None:
        return seen
    kind, size = window
    if kind == "sliding":
        return seen & (query_idx - key_idx < size)
    return seen & (query_idx // size == key_idx // size)


def first_key(window: Window, query: int, start: Union[int, torch.Tensor] = 0) -> int:
    """The earliest key that the query at token index `query`, or any later query, can see, chunks
    beginning at token index `start` (per row (B,): the earliest over the rows)."""
    if window is None:
        return 0
    kind, size = window
    if kind == "sliding":
        return max(0, query - size + 1)
    chunk_start = query - (query - start) % size
    return max(0, int(chunk_start.min()) if isinstance(chunk_start, torch.Tensor) else chunk_start)


def window_mask(queries: int, keys: int, window: Window, device: torch.device, first: int = 0,
                start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(queries, keys - first) boolean mask of the last `queries` of `keys` tokens against keys first..;
    given `start` (B,), the token index where each row's chunks begin: (B, 1, queries, keys - first)."""
    query_idx = torch.arange(keys - queries, keys, device=device).unsqueeze(1)
    key_idx = torch.arange(first, keys, device=device)
    if start is None:
        return visible(query_idx, key_idx, window)
    shift = start.view(-1, 1, 1, 1)  # a sliding window and causality only compare i - j: unchanged
    return visible(query_idx - shift, key_idx - shift, window)


def local_blocks(window: tuple[str, int], shifted_chunks: bool = False) -> tuple[int, int]:
    """(queries per block, earlier blocks each block reads): a chunk and none (and the one before it where
    `shifted_chunks`: chunks that begin at a row's own start straddle two blocks); for a sliding window W
    blocks of W rounded up to a power of two within [64, 256] (measured on CPU: smaller blocks waste
    less of the key span, larger ones make fewer, fuller calls) and as many as W - 1 keys take."""
    kind, size = window
    if kind == "chunked":
        return size, int(shifted_chunks)
    block = min(256, max(64, 1 << (size - 1).bit_length()))
    return block, -(-(size - 1) // block)


def local_is_cheaper(window: tuple[str, int], tokens: int) -> bool:
    """Whether blocks cost less than one (T x T) masked call: chunked always (each query reads at most
    its chunk), sliding while a block's key span is shorter than the row."""
    block, earlier = local_blocks(window)
    return window[0] == "chunked" or (earlier + 1) * block < tokens


class _Spans(torch.autograd.Function):
    """(B, n + m, block, heads, D) -> (B, n, (m + 1) * block, heads, D): span i is blocks i..i+m back to
    back. Backward adds each span's m + 1 pieces onto their blocks: m + 1 strided adds, where autograd
    through `unfold` or slices would scatter or zero-fill the whole input once per piece."""

    @staticmethod
    def forward(ctx, blocks, m):
        ctx.m = m
        n = blocks.shape[1] - m
        return torch.cat([blocks[:, j : j + n] for j in range(m + 1)], dim=2)

    @staticmethod
    def backward(ctx, grad):
        m = ctx.m
        B, n, span, heads, D = grad.shape
        pieces = grad.reshape(B, n, m + 1, span // (m + 1), heads, D)
        grad_blocks = grad.new_zeros(B, n + m, span // (m + 1), heads, D)
        for j in range(m + 1):
            grad_blocks[:, j : j + n] += pieces[:, :, j]
        return grad_blocks, None


def _blocks(x: torch.Tensor, block: int, m: int, tail: int) -> torch.Tensor:
    """(B, heads, T, D) -> (B * n, heads, (m + 1) * block, D): entry i holds tokens [(i - m) * block,
    (i + 1) * block), zero tokens standing in before the row and for the `tail` after it."""
    B, heads, _, D = x.shape
    tokens = x.transpose(1, 2)  # (B, T, heads, D): free for the model's token-major projections
    if m or tail:
        tokens = F.pad(tokens, (0, 0, 0, 0, m * block, tail))
    blocks = tokens.reshape(B, -1, block, heads, D)
    if m:
        blocks = _Spans.apply(blocks, m)
    return blocks.reshape(-1, (m + 1) * block, heads, D).transpose(1, 2)


def local_attention(q, k, v, window: tuple[str, int], doc_ids: Optional[torch.Tensor] = None,
                    start: Optional[torch.Tensor] = None, score_bias=None) -> torch.Tensor:
    """q (B, Hq, T, D), k/v (B, Hk, T, D) -> (B, Hq, T, D) within `window` (size < T), and within one
    document given doc_ids (B, T): each block's mask then also compares document ids. `start` (B,): the
    token index where each row's chunks begin (None: 0). `score_bias` (`ropelab.attention_bias`): formed
    once for a block's (block, key span) distances, the same in every block."""
    B, H, T, D = q.shape
    block, m = local_blocks(window, shifted_chunks=start is not None and window[0] == "chunked")
    n = -(-T // block)
    tail = n * block - T
    queries = _blocks(q, block, 0, tail)
    keys, values = _blocks(k, block, m, tail), _blocks(v, block, m, tail)
    mask = None
    if window[0] == "sliding" or doc_ids is not None or start is not None or score_bias is not None:
        span = (m + 1) * block
        keys_in_span = torch.arange(span, device=q.device)
        queries_in_span = torch.arange(m * block, span, device=q.device).unsqueeze(1)
        # blocks start on chunk boundaries, or a row's chunks start at the same offset in each of its
        # blocks, and a sliding window only depends on i - j: one band fits every block of a row
        shift = 0 if start is None else start.view(-1, 1, 1)
        band = visible(queries_in_span - shift, keys_in_span - shift, window)  # (block, span) or (B, block, span)
        mask = band.unsqueeze(-3).expand(*band.shape[:-2], n, block, span).clone()  # (..., n, block, span)
        first_spans = (torch.arange(m, device=q.device) - m).view(m, 1, 1) * block + keys_in_span  # m <= n as W < T
        mask[..., :m, :, :] &= first_spans >= 0  # not the zero keys standing in before the row
        if doc_ids is not None:
            ids = F.pad(doc_ids, (m * block, tail))
            mask = mask & (ids[:, m * block :].view(B, n, block, 1) == ids.unfold(1, span, block).unsqueeze(2))
        mask = mask.expand(B, n, block, span).reshape(B * n, 1, block, span)
        if score_bias is not None:
            mask = biased_mask(mask, score_bias, queries_in_span - keys_in_span, q.dtype)  # (B * n, H, block, span)
    out = sdpa(queries, keys, values, mask, mask is None)  # (B * n, H, block, D)
    return out.transpose(1, 2).reshape(B, n * block, H, D)[:, :T].transpose(1, 2)
