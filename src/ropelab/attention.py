"""Attention kernels over already-rotated queries and keys, with optional document masking and windows.

A packed window holds several documents; ``doc_ids`` (B, T) names the document of every token
(any integers; a new segment starts wherever the id changes along a row). With a document mask
a token attends causally and only to earlier tokens of its own segment.

An attention window (`ropelab.attention_windows`) narrows that further: ``("sliding", W)`` lets a
query see itself and the W - 1 tokens before it, ``("chunked", C)`` only the earlier tokens of its
own block of C (token indices within the row, not position ids; the blocks begin at token 0, or at
`Documents`' ``chunk_start``: a left-padded batch's rows count their chunks from their first real
token, as transformers does). A key is visible iff it is causal, in the query's document and inside
its window. A window of at least T tokens is full attention.

Backends (``attention.backend``):
  * ``sdpa``   – no document mask: plain causal scaled_dot_product_attention, or with a window one
                 (T x T) window mask;
  * ``dense``  – the reference: SDPA with a dense boolean (T x T) mask per row, so its cost grows
                 with the window length squared whatever the documents;
  * ``varlen`` – segments are gathered into batches of similar length and run as ordinary causal
                 SDPA calls, so cost grows with the sum of squared segment lengths. Lengths are
                 rounded up to one of four sizes per power of two (at most 1/4 padding); padding
                 goes after a segment's last token, where a causal mask keeps it out of every
                 real token's view, so no mask is needed and results match the reference exactly.
                 A sliding window only depends on i - j, so each group attends as a batch without
                 documents (``local`` where cheaper); chunked attention is document masking over
                 segments cut at every C-th token;
  * ``flex``   – FlexAttention with a block mask built from ``doc_ids`` and the window, compiled on
                 CUDA, eager elsewhere (torch has no CPU backward for it, so on CPU it serves
                 inference only). The CPU forward is tested; the CUDA compiled path is not exercised
                 by the test suite (no GPU in CI);
  * ``local``  – windows only: query blocks attend to the keys their window spans, one batched SDPA
                 call, cost O(T * (block + W)) (`attention_windows.local_attention`); with
                 ``doc_ids`` every block's small mask also compares documents; chunks that begin at
                 a ``chunk_start`` span two blocks. Full-attention layers run what ``auto`` picks;
  * ``auto``   – without document ids ``sdpa``, or ``local`` for a window when that is cheaper; with
                 them ``flex`` on CUDA, ``varlen`` otherwise.

`Documents` derives the boundaries once per forward pass (the model wraps ``doc_ids`` before its
first layer), so layers share the dense mask, the varlen grouping or the flex block mask, one of
each per window.

A score bias (``score_bias``, `ropelab.attention_bias`: ALiBi) is taken by every backend, formed only
over what the backend attends: sdpa and dense add it to their (T x T) mask, varlen once per group of
equal-length segments (L x L), local once per block's key span, flex as its ``score_mod`` (no tensor).

With a key/value cache there are fewer queries than keys: the queries are the last tokens, the keys
those the cache holds, which may start after the first token (``key_start``: a windowed layer's
cache drops the keys no later query sees; ``doc_ids`` covers every token seen). Then every backend
is SDPA with a dense mask, causal from the queries' offset (and within one document given
``doc_ids`` and the window; plus the score bias), over the keys from the first one a query can see
(`visible_keys`): one new token at a time that mask is a single row.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Union

import torch

from ropelab.attention_bias import biased_mask, distances
from ropelab.attention_windows import (Window, check_window, first_key, local_attention, local_is_cheaper, sdpa,
                                       visible, window_mask)

BACKENDS = ("auto", "sdpa", "dense", "varlen", "flex", "local")


def document_mask(doc_ids: torch.Tensor, queries: Optional[int] = None) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, Q, T) boolean mask for the last Q = `queries` tokens (default all T):
    causal and within one document."""
    T = doc_ids.shape[-1]
    Q = T if queries is None else queries
    same_doc = doc_ids[:, T - Q:].unsqueeze(-1) == doc_ids.unsqueeze(-2)
    return (same_doc & window_mask(Q, T, None, doc_ids.device)).unsqueeze(1)


def bucket_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Round each length up to m * 2^e with m in [4, 8) (exact below 8): at most 1/4 padding.

    Four sizes per power of two: finer buckets pad less but make more, smaller attention calls,
    and on a busy 2-core CPU the extra gathers and concatenations cost more than they save."""
    octave = torch.clamp(torch.floor(torch.log2(lengths.double())) - 2, min=0).long()
    step = torch.pow(2, octave)
    return (lengths + step - 1) // step * step


class VarlenPlan:
    """Where the varlen backend puts every token: segments sorted by padded length and laid out
    back to back, one group of equal-length rows per padded length, each row stored head-major
    (heads, length, D) so every group is a contiguous (rows, heads, length, D) SDPA input.

    Pad slots read token 0: only pad queries can see them (they follow every real token of their
    segment), so real outputs are untouched, and with zero gradient on pad outputs every pad
    slot's gradient is exactly zero. Moving (token, head) vectors into slots and back is one
    `index_select` each way, forward and backward (`_Reindex`), so the cost stays O(T) however
    many groups. When the segments already tile the tokens in order without padding
    (`identity`), the groups are plain views and nothing is gathered.
    """

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, total: int):
        device = starts.device
        padded = bucket_lengths(lengths)
        order = torch.argsort(padded, stable=True)
        starts, lengths, padded = starts[order], lengths[order], padded[order]
        sizes, counts = torch.unique_consecutive(padded, return_counts=True)
        self.shapes = [(int(c), int(n)) for c, n in zip(counts, sizes)]  # (rows, length) per group
        segment = torch.repeat_interleave(torch.arange(len(padded), device=device), padded)
        first_slot = torch.cumsum(padded, 0) - padded
        self._within = torch.arange(segment.numel(), device=device) - first_slot[segment]
        self._real = self._within < lengths[segment]
        self._token = torch.where(self._real, starts[segment] + self._within, 0)  # (P,) token read by each slot
        self._row_start, self._row_length = first_slot[segment], padded[segment]
        self.identity = segment.numel() == total and bool(torch.equal(self._token, torch.arange(total, device=device)))
        self._slot_of_token = torch.empty(total, dtype=torch.long, device=device)
        self._slot_of_token[self._token[self._real]] = torch.nonzero(self._real).squeeze(1)
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def layout(self, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For `heads` heads: (source row of each slot row, slot row of each source row, slot row
        is real), rows being D-vectors: token-major `token * heads + h` in the source,
        `row_start * heads + h * length + position` in the slots."""
        if heads not in self._layouts:
            h = torch.arange(heads, device=self._token.device).unsqueeze(1)  # (heads, 1)
            slot_rows = self._row_start * heads + h * self._row_length + self._within  # (heads, P)
            source = torch.empty(slot_rows.numel(), dtype=torch.long, device=h.device)
            source[slot_rows.flatten()] = (self._token * heads + h).flatten()
            real = torch.empty_like(source, dtype=torch.bool)
            real[slot_rows.flatten()] = self._real.expand(heads, -1).flatten()
            back = slot_rows[:, self._slot_of_token].t().flatten()  # (tokens * heads,) in token-major order
            self._layouts[heads] = (source, back, real)
        return self._layouts[heads]


class _Reindex(torch.autograd.Function):
    """rows = x[forward_index]; backward reads the incoming gradient at `backward_index` (rows whose
    gradient is zero by construction are not read back, so no scatter-add is needed) and zeroes
    the rows where `backward_keep` is False."""

    @staticmethod
    def forward(ctx, x, forward_index, backward_index, backward_keep):
        ctx.save_for_backward(backward_index, backward_keep)
        return x.index_select(0, forward_index)

    @staticmethod
    def backward(ctx, grad):
        backward_index, backward_keep = ctx.saved_tensors
        grad_x = grad.index_select(0, backward_index)
        if backward_keep is not None:
            grad_x = grad_x * backward_keep.view(-1, *([1] * (grad.dim() - 1)))
        return grad_x, None, None, None


class Documents:
    """Document ids of a batch and, computed on first use, what each backend derives from them
    (masks and block masks one per window, so layers with different windows share one instance).

    `chunk_start` (B,): the token index where each row's chunks begin, its left padding in a
    left-padded batch (transformers' chunked mask counts chunks from a row's first real token);
    None: every row's chunks begin at token 0."""

    def __init__(self, doc_ids: torch.Tensor, chunk_start: Optional[torch.Tensor] = None):
        self.doc_ids = doc_ids
        self.chunk_start = chunk_start
        self._masks: dict[Window, torch.Tensor] = {}
        self._plan: Optional[VarlenPlan] = None
        self._block_masks: dict[Window, object] = {}
        self._chunked: dict[int, Documents] = {}

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat start index and length of every segment (runs of equal ids within a row)."""
        B, T = self.doc_ids.shape
        change = torch.ones(B, T, dtype=torch.bool, device=self.doc_ids.device)
        change[:, 1:] = self.doc_ids[:, 1:] != self.doc_ids[:, :-1]
        starts = change.flatten().nonzero().squeeze(1)
        ends = torch.cat([starts[1:], starts.new_tensor([B * T])])
        return starts, ends - starts

    def cu_seqlens(self) -> torch.Tensor:
        """int32 cumulative segment lengths over the flattened batch, as varlen kernels take them."""
        starts, _ = self.segments()
        return torch.cat([starts, starts.new_tensor([self.doc_ids.numel()])]).to(torch.int32)

    def mask(self, window: Window = None) -> torch.Tensor:
        if window not in self._masks:
            mask = document_mask(self.doc_ids)
            if window is not None:
                T = self.doc_ids.shape[1]
                mask = mask & window_mask(T, T, window, mask.device, start=self.chunk_start)
            self._masks[window] = mask
        return self._masks[window]

    def chunked(self, size: int) -> Documents:
        """These documents cut again at every `size`-th token of a row from its `chunk_start`: causal
        attention within the resulting segments is chunked attention within documents."""
        if size not in self._chunked:
            ids = self.doc_ids
            index = torch.arange(ids.shape[1], device=ids.device)
            if self.chunk_start is not None:
                index = index - self.chunk_start.view(-1, 1)
            starts = (index % size == 0).expand_as(ids).clone()
            starts[:, 1:] |= ids[:, 1:] != ids[:, :-1]
            self._chunked[size] = Documents(starts.cumsum(1))
        return self._chunked[size]

    def plan(self) -> VarlenPlan:
        if self._plan is None:
            starts, lengths = self.segments()
            self._plan = VarlenPlan(starts, lengths, self.doc_ids.numel())
        return self._plan

    def block_mask(self, q_len: int, device: torch.device, window: Window = None):
        if window not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.doc_ids
            start = ids.new_zeros(ids.shape[0]) if self.chunk_start is None else self.chunk_start

            def same_document_in_window(b, h, q_idx, kv_idx):
                return (ids[b, q_idx] == ids[b, kv_idx]) & visible(q_idx - start[b], kv_idx - start[b], window)

            self._block_masks[window] = create_block_mask(same_document_in_window, ids.shape[0], None, q_len, q_len,
                                                          device=device)
        return self._block_masks[window]


def _varlen(q, k, v, docs: Documents, window: Window, score_bias=None) -> torch.Tensor:
    if window is not None and window[0] == "chunked":
        return _varlen(q, k, v, docs.chunked(window[1]), None, score_bias)
    B, H, T, D = q.shape
    plan = docs.plan()

    def groups(x: torch.Tensor) -> list[torch.Tensor]:
        """(B, heads, T, D) -> one (rows, heads, length, D) tensor per group."""
        heads = x.shape[1]
        tokens = x.transpose(1, 2).reshape(B * T, heads, D)  # free for (B, T, heads, D) projections
        if plan.identity:
            pieces = tokens.split([rows * length for rows, length in plan.shapes])
            return [p.view(rows, length, heads, D).transpose(1, 2) for p, (rows, length) in zip(pieces, plan.shapes)]
        source, back, _ = plan.layout(heads)
        slots = _Reindex.apply(tokens.reshape(-1, D), source, back, None)
        pieces = slots.split([rows * heads * length for rows, length in plan.shapes])
        return [p.view(rows, heads, length, D) for p, (rows, length) in zip(pieces, plan.shapes)]

    # a sliding window and a score bias only depend on i - j, so within a group they are the same for every segment
    outputs = [attend(qg, kg, vg, window=window, score_bias=score_bias)
               for qg, kg, vg in zip(groups(q), groups(k), groups(v))]
    if plan.identity:
        out = torch.cat([y.transpose(1, 2).reshape(-1, H, D) for y in outputs])
    else:
        source, back, real = plan.layout(H)
        out = _Reindex.apply(torch.cat([y.reshape(-1, D) for y in outputs]), back, source, real.to(q.dtype))
    return out.view(B, T, H, D).transpose(1, 2)


_compiled_flex = None


def _flex(q, k, v, docs: Documents, window: Window, score_mod=None) -> torch.Tensor:
    """Flex attention over the documents' block mask; `score_mod` (a score bias's, `ropelab.attention_bias`)
    changes each score where it is computed."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    kernel = flex_attention
    if q.is_cuda:  # eager flex materialises the scores; compiled it is a fused kernel
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        kernel = _compiled_flex
    block_mask = docs.block_mask(q.shape[2], q.device, window)
    return kernel(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def resolve_backend(backend: str, doc_ids: Optional[Union[torch.Tensor, Documents]], device: torch.device,
                    window: Window = None, tokens: int = 0) -> str:
    """The backend `attend` runs for `tokens` queries and keys: 'sdpa', 'dense', 'varlen', 'flex' or 'local'.
    `window` as `check_window` returns it (None where it hides nothing)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "local" and window is None:
        backend = "auto"  # full-attention layers of a model with windowed ones
    if doc_ids is None:
        if backend == "local" or (backend == "auto" and window is not None and local_is_cheaper(window, tokens)):
            return "local"
        return "sdpa"
    if backend != "auto":
        return backend
    return "flex" if device.type == "cuda" and flex_available() else "varlen"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[Union[torch.Tensor, Documents]] = None,
    backend: str = "auto",
    window: Window = None,
    key_start: int = 0,
    score_bias=None,
) -> torch.Tensor:
    """q (B, Hq, Tq, D), k/v (B, Hk, T, D), optional doc_ids (B, key_start + T) or `Documents` -> (B, Hq, Tq, D).

    `window`: None (full causal attention), ("sliding", W) or ("chunked", C). `score_bias`: None, or a
    module adding a term to the scores (`ropelab.attention_bias`; ALiBi), taken by every backend.
    With a key/value cache the queries are the last Tq of the key_start + T tokens seen, and k and v
    hold the last T of them: `key_start` > 0 where the cache dropped keys no query sees any more
    (`ropelab.kv_cache`); every key a query sees must be held."""
    Tq, T = q.shape[2], k.shape[2]
    tokens = key_start + T
    window = check_window(window, tokens)
    chosen = resolve_backend(backend, doc_ids, q.device, window, T)
    ids = doc_ids.doc_ids if isinstance(doc_ids, Documents) else doc_ids
    start = doc_ids.chunk_start if isinstance(doc_ids, Documents) else None
    if Tq != T or key_start:
        first, mask = visible_keys(ids, window, Tq, tokens, key_start, q.device, start)
        if score_bias is not None:
            mask = biased_mask(mask, score_bias, distances(Tq, tokens - first, q.device, tokens - Tq, first), q.dtype)
        held = first - key_start
        return sdpa(q, k[:, :, held:], v[:, :, held:], mask, False)
    if chosen == "sdpa":
        if score_bias is None:
            mask = None if window is None else window_mask(T, T, window, q.device)
        else:
            mask = biased_mask(window_mask(T, T, window, q.device), score_bias, distances(T, T, q.device), q.dtype)
        if q.device.type == "cpu":
            # k and v arrive as (B, K, T, D) views of the (B, T, K * D) projections. PyTorch's CPU flash
            # kernel runs faster on them contiguous, as HF's KV cache leaves them (SmolLM2-135M shapes, AMD
            # EPYC Zen 4, 2 threads: 0.62 -> 0.57 s per bf16 call at 8,192 tokens, 3-5% at 512-2,048 tokens,
            # forward + backward; BENCHMARKS.md). One copy of k and v, a third of q's size with grouped
            # heads. Not with a cache (above), where it would copy the whole cache every step.
            k, v = k.contiguous(), v.contiguous()
        return sdpa(q, k, v, mask, mask is None)
    if chosen == "local":
        return local_attention(q, k, v, window, ids, start, score_bias)
    docs = doc_ids if isinstance(doc_ids, Documents) else Documents(doc_ids)
    if chosen == "dense":
        mask = docs.mask(window)
        if score_bias is not None:
            mask = biased_mask(mask, score_bias, distances(T, T, q.device), q.dtype)
        return sdpa(q, k, v, mask, False)
    if chosen == "flex":
        return _flex(q, k, v, docs, window, None if score_bias is None else score_bias.score_mod())
    return _varlen(q, k, v, docs, window, score_bias)


def visible_keys(doc_ids: Optional[torch.Tensor], window: Window, queries: int, tokens: int, key_start: int,
                device: torch.device, start: Optional[torch.Tensor] = None) -> tuple[int, torch.Tensor]:
    """For the last `queries` of `tokens` tokens against a cache holding keys from token `key_start` on:
    (the first key a query sees, the boolean mask (Tq, tokens - first), or (B, 1, Tq, tokens - first) given
    doc_ids (B, tokens) or `start` (B,), where each row's chunks begin). Refuses when the cache lacks a key
    a query sees."""
    first = first_key(window, tokens - queries, 0 if start is None else start)
    if first < key_start:
        raise ValueError(f"attend: the queries see keys from token {first} on, but the cache holds them "
                         f"from token {key_start} only")
    mask = window_mask(queries, tokens, window, device, first, start)
    if doc_ids is not None:
        mask = document_mask(doc_ids, queries)[..., first:] & mask
    return first, mask
