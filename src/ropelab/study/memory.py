"""Position-encoding memory against context length: RoPE cos/sin tables (the partial-RoPE seed's
Figure 1), and what each registered encoding (`ropelab.config.position`) costs besides.

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

An entry may also name registered position types, joined by ``+`` (``rope``, ``nope``, ``fope``,
``alibi``, ``rope+alibi``): the preset with that `model.position` (FoPE's trained length is the preset's
max_seq_len; it changes which frequencies are clipped, not a byte), so RoPE, FoPE, ALiBi and NoPE sit
side by side. Each row also gives, asking the layers' encodings:
  * ``kv_cache_bytes``: the key/value cache of one sequence of seq_len tokens over all layers, from what
    each layer's encodings declare it holds (`KVState`, `kv_cache_bytes`);
  * ``score_bias_bytes``: what one layer's score bias (ALiBi) materialises per call for one sequence of
    seq_len queries and keys (`score_bias_bytes`, backend by backend);
  * ``mixing_macs_per_token``: the multiply-adds per token and call of a learned rotation (FoPE's
    Fourier mixing of its cos/sin, `mixing_macs_per_token`).

`layer_kind_memory` breaks one model config down by layer kind (`model.layer_pattern`): its cos/sin
tables (RoPE layers only) and the key/value cache of one sequence, which a sliding layer bounds by its
window W and a chunked layer by its chunk C (what a cache that drops the keys no query can see any more
holds, as HF's sliding-window caches and ropelab's `KVCache` do), with the same per-call columns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ropelab.config import ConfigError, ModelConfig
from ropelab.config import resolve_rotary_dims
from ropelab.config.mla import cached_values
from ropelab.config.position import POSITION_TYPES, layer_kv_state, parse_position
from ropelab.position.registry import build_rotation, rotation_setting
from ropelab.rope import table_cache_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEFAULT_SEQ_LENS = [2**k for k in range(11, 24, 1)] + [10_000_000]
DEFAULT_FRACTIONS = [0.0, "2ch", 0.1, 0.25, 0.5, 0.75, 1.0]


def position_list(entry) -> Optional[list]:
    """The `model.position` list an entry of position types spells (``rope+alibi``); None for a fraction,
    ``2ch`` or ``pairs:R``."""
    if not isinstance(entry, str) or entry == "2ch" or entry.startswith("pairs:"):
        return None
    return [{"type": name} for name in entry.split("+")]


def parse_entry(text: str):
    """One entry of a fractions list as `memory_table` takes it: ``2ch``, ``pairs:R``, a number in [0, 1] or
    registered position types joined by ``+``."""
    text = text.strip()
    if text == "2ch":
        return text
    if all(name in POSITION_TYPES for name in text.split("+")):
        parse_position(position_list(text), f"--fractions: {text}")
        return text
    if text.startswith("pairs:"):
        keep = text[len("pairs:"):]
        if not (keep.isascii() and keep.isdigit()):
            raise ConfigError(f"--fractions: {text!r}: pairs:R needs R, a whole number of pairs kept per KV head")
        return f"pairs:{int(keep)}"
    try:
        fraction = float(text)
    except ValueError:
        raise ConfigError(f"--fractions: {text!r}: must be a number in [0, 1], 2ch, pairs:R or position types joined "
                          f"by + ({', '.join(POSITION_TYPES)})") from None
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--fractions: {text!r}: a fraction must be in [0, 1] (0 = NoPE, 1 = full RoPE)")
    return fraction


def kept_pairs_of(fraction) -> Optional[int]:
    """R of a ``pairs:R`` entry, None for a fraction or ``2ch``."""
    return int(fraction[len("pairs:"):]) if isinstance(fraction, str) and fraction.startswith("pairs:") else None


def entry_config(config: ModelConfig, entry) -> ModelConfig:
    """`config` with one table entry applied: position types as its `model.position` (FoPE trained at the
    preset's max_seq_len), else the entry's rotated channels (a plan's kept pairs in the first 2R)."""
    entries = position_list(entry)
    if entries is None:
        rope = dataclasses.replace(config.rope, rotary_dims=rotary_dims_for(config, entry))
        return dataclasses.replace(config, rope=rope)
    for item in entries:
        if item["type"] == "fope":
            item["trained_length"] = config.max_seq_len
    return dataclasses.replace(config, position=entries)


def rotary_dims_for(config: ModelConfig, fraction) -> int:
    if position_list(fraction) is not None:
        return entry_config(config, fraction).rope.resolve_dims(config.head_size)
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
        for fraction in fractions:
            config = entry_config(ModelConfig.from_name(preset), fraction)
            r = rotary_dims_for(config, fraction)
            labels = position_labels(config)
            mixing = max(mixing_macs_per_token(config, layer) for layer in range(config.n_layer))
            for seq_len in seq_lens:
                row = {"preset": preset, "fraction": fraction, "rotary_dims": r, "seq_len": seq_len, "gpus": gpus}
                for layout in ("ropelab", "duplicated"):
                    total = cache_bytes(seq_len, r, layout, dtype)
                    row[f"{layout}_bytes_replicated"] = total
                    row[f"{layout}_bytes_sharded"] = -(-total // gpus)
                row |= {"position": labels, "mixing_macs_per_token": mixing,
                        "kv_cache_bytes": sum(kv_cache_bytes(config, layer, seq_len, dtype)
                                              for layer in range(config.n_layer)),
                        "score_bias_bytes": max(score_bias_bytes(config, layer, seq_len, seq_len, dtype)
                                                for layer in range(config.n_layer))}
                rows.append(row)
    return rows


def position_labels(config: ModelConfig, layers=None) -> str:
    """The labels of the encodings of `layers` (default all), as reports write them: "RoPE + ALiBi"; a NoPE
    slot under a score bias is left out (ALiBi alone is "ALiBi")."""
    labels = {}
    for layer in range(config.n_layer) if layers is None else layers:
        entries = config.positions_for_layer(layer)
        named = [entry for entry in entries if entry.type.name != "nope"] or entries
        labels[" + ".join(entry.type.label for entry in named)] = None
    return ", ".join(labels)


def kv_cache_bytes(config: ModelConfig, layer: int, seq_len: int, dtype: str = "bf16") -> int:
    """What `layer` must keep in a KV cache for one sequence of `seq_len` tokens: per token, what its
    encodings declare (`KVState`: keys and values of head_dim per KV head, plus any extra state), for
    every token under full attention, at most the window W (sliding: the last query sees itself and W - 1
    before it) or the chunk C (chunked: the last query sees the tokens of its own chunk)."""
    kind = config.layer_kind(layer)
    tokens = seq_len if kind.attention == "full" else min(seq_len, kind.window)
    if config.mla is not None:  # a latent layer (`model.mla`): its latent and rotated key channels per KV head
        rotary_dims = config.rope_for_layer(layer).resolve_dims(config.head_size)
        return config.kv_heads * cached_values(config.mla.rank, rotary_dims) * tokens * DTYPE_BYTES[dtype]
    state = layer_kv_state(config.positions_for_layer(layer))
    return state.numbers_per_token(config.kv_heads, config.head_size) * tokens * DTYPE_BYTES[dtype]


def score_bias_bytes(config: ModelConfig, layer: int, queries: int, keys: int, dtype: str = "bf16",
                     backend: str = "sdpa") -> int:
    """Bytes `layer`'s score bias (the `score_bias` channel: ALiBi) materialises per call for one sequence of
    `queries` queries over `keys` keys (a KV-cached decode: the new tokens over the held ones). On flex
    (`backend` "flex": CUDA with document ids, or asked for) the bias is a score_mod: 0. On sdpa and dense
    (`ropelab.attention`) the fp32 bias (H, Tq, Tk) and the float mask made from it in the model dtype are
    held while attention runs, H x Tq x Tk x (4 + dtype bytes); with document ids the dense mask is per
    sequence of the batch, as counted here. Under autograd SDPA keeps each layer's mask for its backward
    (n_layer of them at once). varlen forms it per group of equal-length documents (this figure with
    queries = keys = the documents' length), local per block band (bounded by the window)."""
    if backend == "flex":
        return 0
    biases = sum(entry.type.channel == "score_bias" for entry in config.positions_for_layer(layer))
    return biases * config.n_head * queries * keys * (4 + DTYPE_BYTES[dtype])


def mixing_macs_per_token(config: ModelConfig, layer: int) -> int:
    """Multiply-adds per token a learned rotation (`learned` in the registry: FoPE) spends on every call
    mixing its cos/sin by its coefficients: one per coefficient (FoPE: 2 x (r/2)^2); 0 for the others."""
    if not config.positions_for_layer(layer)[0].type.learned:
        return 0
    return sum(parameter.numel() for parameter in build_rotation(config, layer).parameters())


def angles_per_token(config: ModelConfig, layer: int) -> int:
    """Angles (position x frequency, each an fp32 cos and sin) `layer`'s rotation forms per token on every
    call: none from a table, its rotated pairs with ``cache: none``, K x R under a per-KV-head plan."""
    rotation = build_rotation(config, layer)
    if not rotation.rotary_dims or rotation.table_bytes(1):
        return 0
    return (config.kv_heads if rotation.per_head else 1) * rotation.rotary_dims // 2


def layer_kind_memory(config: ModelConfig, seq_len: int, dtype: str = "bf16") -> list[dict]:
    """One row per layer kind (one, ``-``, without `model.layer_pattern`): its layers, attention, rotated
    channels, the bytes of the fp32 cos/sin tables its RoPE settings hold at `seq_len` positions (a setting
    shared with an earlier kind is counted there, once, as the model shares it), the bytes of its
    layers' key/value cache for one sequence of `seq_len` tokens in `dtype` (`kv_cache_bytes`), its
    encodings' labels (`position`) and, for its costliest layer, per call: the score bias materialised on
    the SDPA path (`score_bias_bytes`), the angles formed per token (`angles_per_token`) and a learned
    rotation's mixing (`mixing_macs_per_token`)."""
    rows: dict[str, dict] = {}
    counted: set[str] = set()
    for layer in range(config.n_layer):
        name = config.kind_for_layer(layer) or "-"
        kind = config.layer_kind(layer)
        rope = config.rope_for_layer(layer)
        row = rows.setdefault(name, {
            "kind": name, "layers": [], "attention": kind.attention, "window": kind.window,
            "rotary_dims": set(), "temperature": kind.temperature is not None, "seq_len": seq_len,
            "rope_table_bytes": 0, "kv_cache_bytes": 0, "score_bias_bytes": 0, "angles_per_token": 0,
            "mixing_macs_per_token": 0,
        })
        row["layers"].append(layer)
        row["rotary_dims"].add(rope.resolve_dims(config.head_size))
        row["kv_cache_bytes"] += kv_cache_bytes(config, layer, seq_len, dtype)
        row["score_bias_bytes"] = max(row["score_bias_bytes"], score_bias_bytes(config, layer, seq_len, seq_len, dtype))
        row["angles_per_token"] = max(row["angles_per_token"], angles_per_token(config, layer))
        row["mixing_macs_per_token"] = max(row["mixing_macs_per_token"], mixing_macs_per_token(config, layer))
        setting = rotation_setting(config, layer)[0]  # as `Transformer` shares its rotation modules
        if setting not in counted:
            counted.add(setting)
            row["rope_table_bytes"] += build_rotation(config, layer).table_bytes(seq_len)
    for row in rows.values():
        row["rotary_dims"] = sorted(row["rotary_dims"])
        row["position"] = position_labels(config, row["layers"])
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
            elif position_list(fraction) is not None:
                label = sel[0]["position"]
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
