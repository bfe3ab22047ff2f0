"""Selected-pair RoPE plans: which frequency pairs of each KV head keep rotating (MHA2MLA's partial RoPE).

A head of `head_dim` channels has ``n = head_dim/2`` frequency pairs; pair i turns at
``theta^(-2i/head_dim)`` (the full-head spectrum; i = 0 is the fastest). A plan keeps r of them per KV
head; the query heads of a GQA group share their group's. Strategies (Ji et al. 2025, "Towards
Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any Transformer-based LLMs",
arXiv 2502.14837, section 3.1):
  high      pairs 0..r-1 (the fastest, as `truncate` keeps them)
  low       pairs n-r..n-1 (the slowest)
  uniform   pairs 0, n/r, 2n/r, ... (every (n/r)-th pair, rounded down)
  2-norm    per KV head, the r pairs with the largest score: the mean over calibration tokens of
            ||q pair|| * ||k pair|| (pre-RoPE), summed over the group's query heads (`pair_scores`)

A model holding a plan keeps its kept pairs in the first 2r channels of each head, in the layer's pair
layout, so the first-K fast path rotates them: `channel_order` gives the permutation of a source
head's channels that puts them there (q.k is unchanged when queries and keys are permuted alike).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ropelab.config.rope import RopeConfig
from ropelab.errors import ConfigError

STRATEGIES = ("high", "low", "uniform", "2-norm")


def select_pairs(strategy: str, n_pairs: int, keep: int) -> list[int]:
    """The `keep` pair indices (ascending) that `strategy` (high, low or uniform) keeps of `n_pairs`."""
    if strategy == "high":
        return list(range(keep))
    if strategy == "low":
        return list(range(n_pairs - keep, n_pairs))
    if strategy == "uniform":
        return [j * n_pairs // keep for j in range(keep)]
    raise ConfigError(f"rope.select={strategy!r}: needs calibration scores; the strategies without are high, low, uniform")


def top_pairs(scores: torch.Tensor, keep: int) -> list[list[int]]:
    """Per KV head (row of `scores` (K, n_pairs)), the `keep` highest-scoring pair indices, ascending.
    Ties go to the faster (lower-index) pair, so the choice is deterministic."""
    order = torch.argsort(-scores.double(), dim=-1, stable=True)[:, :keep]
    return [sorted(row.tolist()) for row in order]


def pair_scores(q_norms: torch.Tensor, k_norms: torch.Tensor) -> torch.Tensor:
    """MHA2MLA's 2-norm score per KV head and pair, (K, n_pairs).

    q_norms (H, n_pairs) and k_norms (K, n_pairs) are the means over calibration tokens of each pre-RoPE
    pair's L2 norm; query head h belongs to KV group h // (H/K). Score = sum over the group's query heads
    of mean||q|| * mean||k||."""
    H, K = q_norms.shape[0], k_norms.shape[0]
    grouped = q_norms.double().view(K, H // K, -1).sum(1)  # (K, n_pairs)
    return grouped * k_norms.double()


def pair_norms(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x (B, heads, T, head_dim) -> (heads, head_dim/2): each pair's L2 norm, summed over B and T."""
    half = x.shape[-1] // 2
    if layout == "half":
        a, b = x[..., :half], x[..., half:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    return torch.sqrt(a.double() ** 2 + b.double() ** 2).sum(dim=(0, 2))


def kept_pairs(rope: RopeConfig, head_dim: int, kv_heads: int) -> Optional[list[list[int]]]:
    """Per KV head, the pair indices a layer's plan keeps (in channel order), or None without a plan."""
    if not rope.has_plan:
        return None
    if rope.pairs is not None:
        per_head = bool(rope.pairs) and isinstance(rope.pairs[0], list)
        return [list(p) for p in rope.pairs] if per_head else [list(rope.pairs) for _ in range(kv_heads)]
    keep = select_pairs(rope.select, head_dim // 2, int(rope.keep_pairs))
    return [keep for _ in range(kv_heads)]


def channel_order(kept: Sequence[int], head_dim: int, layout: str) -> torch.Tensor:
    """(head_dim,) long: new channel c of a head holds source channel order[c]; the kept pairs (in the
    order given) take the first 2r channels in `layout`, the dropped pairs follow in ascending order."""
    n = head_dim // 2
    chosen = set(kept)
    dropped = [i for i in range(n) if i not in chosen]
    if layout == "half":  # pair i is channels (i, i + n); after: (j, j + r) for the j-th kept pair
        rotated = [*kept, *(i + n for i in kept)]
        passed = [*dropped, *(i + n for i in dropped)]
        return torch.tensor(rotated + passed, dtype=torch.long)
    return torch.tensor([c for i in (*kept, *dropped) for c in (2 * i, 2 * i + 1)], dtype=torch.long)


def head_rows(order_per_kv_head: list[torch.Tensor], heads: int, head_dim: int) -> torch.Tensor:
    """Row permutation of a (heads * head_dim, ...) projection: head h uses its KV group's channel order."""
    group = heads // len(order_per_kv_head)
    return torch.cat([order_per_kv_head[h // group] + h * head_dim for h in range(heads)])


__all__ = ["STRATEGIES", "select_pairs", "top_pairs", "pair_scores", "pair_norms", "kept_pairs", "channel_order",
           "head_rows"]
