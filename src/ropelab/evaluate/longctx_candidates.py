"""Answer candidates scored after their prompt, for the retrieval tasks of `ropelab.evaluate.longctx`.

Each prompt runs once with its keys and values kept (the model keeps none of its own during a plain
forward; a small stand-in for its attention does); then all of the prompt's candidates run side by
side in one short row, every candidate at the positions right after the prompt and blind to the
others: one pass of the prompt plus a few tokens per candidate, instead of a pass per candidate.
The kept keys and values can go on into a `ropelab.kv_cache.KVCache` for greedy generation after the
prompt.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ropelab.attention import attend
from ropelab.attention_windows import visible
from ropelab.kv_cache import KVCache


def rank_of_true(scores: Sequence[float]) -> float:
    """Rank of scores[0] among all scores, higher is better: 1 + better + ties / 2."""
    true, others = scores[0], np.asarray(scores[1:])
    return 1.0 + float((others > true).sum()) + 0.5 * float((others == true).sum())


class _PrefixAttention(nn.Module):
    """Stands in for one `ropelab.model.Attention` while prompts are scored. The first forward (the
    prompts) is ordinary causal attention and keeps the rotated keys and values; the second (each
    prompt's answer candidates laid side by side in one row, every candidate at the positions right
    after its prompt) attends to those keys and values plus the keys of its own row as
    `suffix_mask` allows."""

    def __init__(self, attention: nn.Module, suffix_mask: torch.Tensor):
        super().__init__()
        self.inner = attention
        self.suffix_mask = suffix_mask  # (T, P + T) bool: which prompt and row keys each row token sees
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.cached: tuple[torch.Tensor, torch.Tensor] = ()  # what a KV cache holds for the prompt

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, doc_ids=None, kv_cache=None,
                norm: Optional[nn.Module] = None) -> torch.Tensor:
        a = self.inner  # `kv_cache`: the model's own cache, never given here (this class is the prefix cache)
        B, T, _ = x.shape
        q, k, v = a.queries_keys_values(x, position_ids, norm)  # (B, H, T, D), (B, K, T, D) x 2
        if self.keys is None:
            self.keys, self.values = k, v
            # an attention whose cache holds something else than its keys and values (MLA: the latent) says what
            entries = getattr(a, "cache_entries", None)
            self.cached = (k, v) if entries is None else entries(x, position_ids, norm)
            y = attend(q, k, v, window=a.window)
        else:
            mask = self.suffix_mask
            if a.window is not None:  # a candidate token sees the prompt's and its own keys within its window
                query_positions = position_ids[0]
                key_positions = torch.cat([torch.arange(self.keys.shape[2], device=x.device), query_positions])
                mask = mask & visible(query_positions[:, None], key_positions[None, :], a.window)
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.n_head != a.n_kv_head)
        return a.o_proj(y.transpose(1, 2).reshape(B, T, a.n_head * a.head_dim))


@contextmanager
def _prefix_cache(model, suffix_mask: torch.Tensor):
    blocks = list(getattr(model, "blocks", []))
    originals = [block.attn for block in blocks]
    try:
        for block in blocks:
            block.attn = _PrefixAttention(block.attn, suffix_mask)
        yield [block.attn for block in blocks]
    finally:
        for block, attention in zip(blocks, originals):
            block.attn = attention


def candidate_slots(candidates: Sequence[Sequence[Sequence[int]]], pad_id: int) -> torch.Tensor:
    """(N, C, A) token ids: candidate c of prompt n, padded with `pad_id` to the longest, A."""
    width = max(len(c) for row in candidates for c in row)
    slots = torch.full((len(candidates), len(candidates[0]), width), pad_id, dtype=torch.long)
    for n, row in enumerate(candidates):
        for c, candidate in enumerate(row):
            slots[n, c, : len(candidate)] = torch.tensor(candidate, dtype=torch.long)
    return slots


@torch.no_grad()
def candidate_logits(model, prompts: np.ndarray, slots: torch.Tensor, device="cpu",
                     keep: Optional[KVCache] = None) -> torch.Tensor:
    """Logits (N, C, A + 1, V) for prompts (N, L) and their candidates `slots` (N, C, A): [n, c, 0]
    after prompt n, [n, c, k] after its candidate c's first k tokens (past a candidate's end: padding).
    `model` needs `hidden_states(ids, position_ids)`, `lm_head` and (optionally) `blocks[i].attn`.
    `keep`: an empty KVCache that receives, layer by layer, what each attention caches for the prompts
    (its keys and values, or what its `cache_entries` gives)."""
    (N, L), (_, C, A) = prompts.shape, slots.shape
    positions = (L + torch.arange(A)).repeat(C).expand(N, C * A)
    slot = torch.arange(C * A)
    own_past = (slot[:, None] // A == slot[None, :] // A) & (slot[:, None] >= slot[None, :])
    suffix_mask = torch.cat([torch.ones(C * A, L, dtype=torch.bool), own_past], dim=1).to(device)
    with _prefix_cache(model, suffix_mask) as attentions:
        last = model.hidden_states(torch.from_numpy(prompts).to(device))[:, -1:]  # (N, 1, d_model)
        hidden = model.hidden_states(slots.flatten(1).to(device), position_ids=positions.to(device))  # (N, C*A, d_model)
    if keep is not None:
        keep.hold([a.cached[0] for a in attentions], [a.cached[1] for a in attentions])
    hidden = torch.cat([last[:, None].expand(N, C, 1, -1), hidden.view(N, C, A, -1)], dim=2)  # (N, C, A + 1, d_model)
    return model.lm_head(hidden).float()


def candidate_scores(logits: torch.Tensor, slots: torch.Tensor, candidates: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """(N, C) summed log-probability of each candidate, from `candidate_logits` and its `slots`."""
    lengths = torch.tensor([[len(c) for c in row] for row in candidates])
    valid = torch.arange(slots.shape[2]) < lengths[..., None]  # (N, C, A)
    token_logprobs = F.log_softmax(logits[:, :, :-1], dim=-1).gather(-1, slots.to(logits.device)[..., None])[..., 0]
    return (token_logprobs.cpu() * valid).sum(-1)
