"""RoPE cos/sin cache memory against context length (the partial-RoPE seed's Figure 1).

Three layouts are reported per preset, fraction and sequence length:
  * ``ropelab``  – what `RotaryEmbedding` holds with ``cache: table``: cos and sin of
    (seq_len, rotary_dims/2) in fp32, one table shared by all layers with equal settings;
  * ``duplicated`` – the common HF / GPT-NeoX layout: cos and sin of (seq_len, rotary_dims),
    each frequency stored twice, in the model dtype;
  * ``none``     – ``cache: none`` computes cos/sin on the fly: 0 persistent bytes.
Across N GPUs a cache is either replicated (every GPU holds all positions) or sharded by
sequence (each GPU holds seq_len / N positions).

Besides fractions (and ``2ch``, two channels), an entry ``pairs:R`` is a selected-pair plan
(`ropelab.rope.pairs`) keeping R of the head_dim/2 frequency pairs of every KV head, the same
pairs in every KV head: its kept pairs sit in the first 2R channels, so it holds what partial
RoPE with rotary_dims 2R holds, a table of (seq_len, R) cos and sin (one per distinct layer plan;
a plan equal in every layer, as ``select: high|low|uniform`` gives, holds one). A plan whose KV
heads keep different pairs (`RotaryEmbedding.per_head`, e.g. ``select: 2-norm``) holds no table
at any length: each layer forms K x R angles per token on every call (`per_head_angles`).

`layer_kind_memory` breaks one model config down by layer kind (`model.layer_pattern`): its cos/sin
tables (RoPE layers only) and the key/value cache of one sequence, which a sliding layer bounds by its
window W and a chunked layer by its chunk C (what a cache that drops the keys no query can see any more
holds, as HF's sliding-window caches and ropelab's `KVCache` do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ropelab.config import ConfigError, ModelConfig
from ropelab.config import resolve_rotary_dims
from ropelab.config.mla import cached_values
from ropelab.position.registry import build_rotation, rotation_setting
from ropelab.rope import table_cache_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEFAULT_SEQ_LENS = [2**k for k in range(11, 24, 1)] + [10_000_000]
DEFAULT_FRACTIONS = [0.0, "2ch", 0.1, 0.25, 0.5, 0.75, 1.0]


def parse_entry(text: str):
    """One entry of a fractions list as `memory_table` takes it: ``2ch``, ``pairs:R`` or a number in [0, 1]."""
    text = text.strip()
    if text == "2ch":
        return text
    if text.startswith("pairs:"):
        keep = text[len("pairs:"):]
        if not (keep.isascii() and keep.isdigit()):
            raise ConfigError(f"--fractions: {text!r}: pairs:R needs R, a whole number of pairs kept per KV head")
        return f"pairs:{int(keep)}"
    try:
        fraction = float(text)
    except ValueError:
        raise ConfigError(f"--fractions: {text!r}: must be a number in [0, 1], 2ch or pairs:R") from None
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--fractions: {text!r}: a fraction must be in [0, 1] (0 = NoPE, 1 = full RoPE)")
    return fraction


def kept_pairs_of(fraction) -> Optional[int]:
    """R of a ``pairs:R`` entry, None for a fraction or ``2ch``."""
    return int(fraction[len("pairs:"):]) if isinstance(fraction, str) and fraction.startswith("pairs:") else None


def rotary_dims_for(config: ModelConfig, fraction) -> int:
    if fraction == "2ch":
        return 2
    keep = kept_pairs_of(fraction)
    if keep is not None:
        if keep > config.head_size // 2:
            raise ConfigError(f"--fractions: {fraction}: {config.name} has {config.head_size // 2} frequency pairs "
                              f"per head (head_dim {config.head_size})")
        return 2 * keep
    return resolve_rotary_dims(config.head_size, float(fraction))


def per_head_angles(config: ModelConfig, keep: int) -> int:
    """Angles a layer with a per-KV-head plan keeping `keep` pairs forms per token on each call (K x R);
    each is held as an fp32 cos and sin. (Its rotation also repeats them for the query heads of each
    KV group, H x R more while the layer rotates; under autograd both stay until its backward.)"""
    return config.kv_heads * keep


def cache_bytes(seq_len: int, rotary_dims: int, layout: str = "ropelab", dtype: str = "bf16") -> int:
    if layout == "none" or rotary_dims == 0:
        return 0
    if layout == "ropelab":
        return table_cache_bytes(seq_len, rotary_dims, 4)
    return 2 * seq_len * rotary_dims * DTYPE_BYTES[dtype]


def memory_table(presets: list[str], fractions=DEFAULT_FRACTIONS, seq_lens=DEFAULT_SEQ_LENS, dtype: str = "bf16",
                 gpus: int = 1) -> list[dict]:
    rows = []
    for preset in presets:
        config = ModelConfig.from_name(preset)
        for fraction in fractions:
            r = rotary_dims_for(config, fraction)
            for seq_len in seq_lens:
                row = {"preset": preset, "fraction": fraction, "rotary_dims": r, "seq_len": seq_len, "gpus": gpus}
                for layout in ("ropelab", "duplicated"):
                    total = cache_bytes(seq_len, r, layout, dtype)
                    row[f"{layout}_bytes_replicated"] = total
                    row[f"{layout}_bytes_sharded"] = -(-total // gpus)
                rows.append(row)
    return rows


def kv_cache_bytes(config: ModelConfig, layer: int, seq_len: int, dtype: str = "bf16") -> int:
    """Keys and values of one sequence of `seq_len` tokens that `layer` must keep: every token under full
    attention, at most the window W (sliding: the last query sees itself and W - 1 before it) or the chunk
    C (chunked: the last query sees the tokens of its own chunk)."""
    kind = config.layer_kind(layer)
    tokens = seq_len if kind.attention == "full" else min(seq_len, kind.window)
    per_head = 2 * config.head_size  # a latent layer (`model.mla`): its latent and rotated key channels instead
    if config.mla is not None:
        per_head = cached_values(config.mla.rank, config.rope_for_layer(layer).resolve_dims(config.head_size))
    return config.kv_heads * per_head * tokens * DTYPE_BYTES[dtype]


def layer_kind_memory(config: ModelConfig, seq_len: int, dtype: str = "bf16") -> list[dict]:
    """One row per layer kind (one, ``-``, without `model.layer_pattern`): its layers, attention, rotated
    channels, the bytes of the fp32 cos/sin tables its RoPE settings hold at `seq_len` positions (a setting
    shared with an earlier kind is counted there, once, as the model shares it) and the bytes of its
    layers' key/value cache for one sequence of `seq_len` tokens in `dtype` (`kv_cache_bytes`)."""
    rows: dict[str, dict] = {}
    counted: set[str] = set()
    for layer in range(config.n_layer):
        name = config.kind_for_layer(layer) or "-"
        kind = config.layer_kind(layer)
        rope = config.rope_for_layer(layer)
        row = rows.setdefault(name, {
            "kind": name, "layers": [], "attention": kind.attention, "window": kind.window,
            "rotary_dims": set(), "temperature": kind.temperature is not None, "seq_len": seq_len,
            "rope_table_bytes": 0, "kv_cache_bytes": 0, "position": set(),
        })
        row["layers"].append(layer)
        row["rotary_dims"].add(rope.resolve_dims(config.head_size))
        row["kv_cache_bytes"] += kv_cache_bytes(config, layer, seq_len, dtype)
        row["position"].update(entry.type.name for entry in config.positions_for_layer(layer))
        setting = rotation_setting(config, layer)[0]  # as `Transformer` shares its rotation modules
        if setting not in counted:
            counted.add(setting)
            row["rope_table_bytes"] += build_rotation(config, layer).table_bytes(seq_len)
    for row in rows.values():
        row["rotary_dims"] = sorted(row["rotary_dims"])
        row["position"] = sorted(row["position"])
    return list(rows.values())


def plot_memory(rows: list[dict], path: Path, layout: str = "duplicated") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for fraction in dict.fromkeys(r["fraction"] for r in rows if r["preset"] == preset):
            sel = [r for r in rows if r["preset"] == preset and r["fraction"] == fraction]
            ys = [r[f"{layout}_bytes_replicated"] / 2**30 for r in sel]
            if not any(ys):
                continue
            keep = kept_pairs_of(fraction)
            if fraction == "2ch":
                label = "two channels"
            else:
                label = f"{keep} pairs" if keep is not None else f"{float(fraction):.0%}"
            ax.plot([r["seq_len"] for r in sel], ys, marker="o", ms=3, label=f"{label} ({sel[0]['rotary_dims']} dims)")
        ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="cos/sin cache (GiB, per GPU, replicated)",
               title=f"{preset}: {layout} cache")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
