"""Key/value cache bytes of MHA/GQA against multi-head latent attention, per budget and context length.

Per token and layer a KV head caches 2 x head_dim values with whole keys and values, d + 2r with the latent
(`ropelab.config.mla.cached_values`): r RoPE pairs kept (the rotated key channels) and a latent of rank d.
MHA2MLA's repository config for SmolLM-135M (JT-Ushio/MHA2MLA, cfgs/SmolLM1-135M-4GPU.yml: 2 pairs and rank 8
per KV head, over 3 KV heads of 64 channels) caches 36 of 384 values per layer (-90.6%); its paper's 135M rows
(Ji et al. 2025, arXiv 2502.14837 v1, Table 1) keep 4 pairs: -87.5% at rank 8. Torch-free: `ropelab memory --mla`
reads it.
"""

from __future__ import annotations

from ropelab.config import ConfigError, ModelConfig
from ropelab.config.mla import cached_values, full_rank

SEQ_LENS = (2048, 8192, 32_768, 131_072)


def parse_budgets(text: str) -> list[tuple[int, int]]:
    """``R:D,...`` -> [(pairs kept per KV head, latent rank per KV head), ...]."""
    budgets = []
    for entry in (part.strip() for part in text.split(",") if part.strip()):
        pairs, _, rank = entry.partition(":")
        if not (pairs.isascii() and pairs.isdigit() and rank.isascii() and rank.isdigit()):
            raise ConfigError(f"--mla: {entry!r}: each budget is PAIRS:RANK per KV head, e.g. 2:8")
        budgets.append((int(pairs), int(rank)))
    if not budgets:
        raise ConfigError("--mla: give one or more budgets PAIRS:RANK, e.g. 2:8,4:16")
    return budgets


def check_budget(config: ModelConfig, pairs: int, rank: int, name: str) -> None:
    D = config.head_size
    if pairs > D // 2:
        raise ConfigError(f"--mla {pairs}:{rank}: {name} has {D // 2} pairs per KV head (head_dim {D})")
    top = full_rank(config.d_model, D, 2 * pairs)
    if not 1 <= rank <= top:
        raise ConfigError(f"--mla {pairs}:{rank}: the rank must be in 1..{top} for {name} (full rank: min of d_model "
                          f"{config.d_model} and (head_dim - 2r) + head_dim)")


def mla_cache_rows(config: ModelConfig, name: str, budgets: list[tuple[int, int]], value_bytes: int = 2,
                   seq_lens=SEQ_LENS) -> list[dict]:
    """One row for the model's own cache (every layer's whole keys and values, K x 2D per token and layer)
    and one per budget (K x (d + 2r)): values and bytes per token and layer, per token over all layers, and
    one sequence's bytes at each of `seq_lens` (every layer full attention), `value_bytes` a value."""
    for pairs, rank in budgets:
        check_budget(config, pairs, rank, name)
    K, layers, size = config.kv_heads, config.n_layer, value_bytes
    full = K * 2 * config.head_size
    rows = []
    for label, values in [("MHA" if K == config.n_head else "GQA", full),
                          *((f"MLA r={pairs} d={rank}", K * cached_values(rank, 2 * pairs)) for pairs, rank in budgets)]:
        rows.append({"model": name, "cache": label, "values_per_token_layer": values,
                     "bytes_per_token_layer": values * size, "bytes_per_token": values * size * layers,
                     "saved": round(1 - values / full, 4),
                     **{f"bytes_at_{n}": values * size * layers * n for n in seq_lens}})
    return rows


__all__ = ["SEQ_LENS", "parse_budgets", "check_budget", "mla_cache_rows"]
