"""Shape and block design of a transformer (`ModelConfig`) and its named presets (`MODEL_PRESETS`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from ropelab.config.checks import FLOAT32_TINY, check_float, check_ints
from ropelab.config.coerce import from_dict
from ropelab.config.layout import LayerKind, check_pattern
from ropelab.config.layout_presets import LAYOUT_PRESETS
from ropelab.config.mla import MLAConfig
from ropelab.config.position import Position, default_position, parse_position, rope_overlay
from ropelab.config.rope import PLAN_KEYS, RopeConfig
from ropelab.errors import ConfigError, quoted


def _layer_index(key: object) -> Optional[int]:
    """The layer a `model.rope_layers` (or `model.position_layers`) key names: an int, or its decimal text as a dotted override writes it
    (``model.rope_layers.3.fraction=0``); None for anything else (a bool, a float, ``"03"``)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and key == str(int(key)):
        return int(key)
    return None


def _lay_over(rope: RopeConfig, override: dict, key: str) -> RopeConfig:
    """`rope` with the RoPE keys of `override` (a layer kind's, a layer's or `model.position`'s) laid over it."""
    merged = dataclasses.asdict(rope)
    # Setting its own channel count or plan drops the run's plan (e.g. {fraction: 0} is NoPE).
    if set(override) & {"fraction", "rotary_dims", *PLAN_KEYS}:
        merged.update(dict.fromkeys(PLAN_KEYS))
    if "fraction" in override and "rotary_dims" not in override:  # a fraction replaces a channel count
        merged["rotary_dims"] = None
    return from_dict(RopeConfig, merged | dict(override), key)


@dataclass
class ModelConfig:
    """Shape and block design of one decoder-only transformer."""

    name: str = "custom"
    vocab_size: Optional[int] = None  # None: follow the tokenizer (padded to a multiple of 64)
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    n_kv_head: Optional[int] = None  # None: same as n_head (no GQA)
    head_dim: Optional[int] = None  # None: d_model // n_head
    d_ff: int = 704
    block: Literal["sequential", "parallel"] = "sequential"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    attn_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 131_072
    init_std: float = 0.02
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Per-layer exceptions: {layer_index: {rope keys}}; e.g. {3: {fraction: 0}} for a NoPE layer.
    rope_layers: dict = field(default_factory=dict)
    # Layer kinds repeated over the layers (ropelab.config.layout): RoPE, attention window, temperature.
    layer_pattern: Optional[str] = None
    layer_kinds: dict[str, LayerKind] = field(default_factory=dict)
    # Position encodings (ropelab.config.position): e.g. [{type: rope, fraction: 0.25}, {type: alibi}];
    # None: model.rope alone. Its rotation entry's RoPE keys are laid over model.rope here.
    position: Optional[list] = None
    # Per-layer lists in place of model.position and the layer kind's: {layer_index: [entries]}; e.g.
    # {3: [{type: alibi}]}. A list's rotation entry gives the layer's RoPE keys (as model.rope_layers would).
    position_layers: dict = field(default_factory=dict)
    # Multi-head latent attention (ropelab.config.mla): None, or the latent's rank per KV head.
    mla: Optional[MLAConfig] = None

    def __post_init__(self) -> None:
        if self.position is not None and isinstance(self.rope, RopeConfig):
            self.rope = _lay_over(self.rope, rope_overlay(parse_position(self.position)), "model.position")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    def kind_for_layer(self, layer: int) -> Optional[str]:
        """The layer's kind in `layer_pattern` (None without a pattern)."""
        return self.layer_pattern[layer % len(self.layer_pattern)] if self.layer_pattern else None

    def layer_kind(self, layer: int) -> LayerKind:
        """The layer's `LayerKind` (full attention, `model.rope` as it is, without a pattern)."""
        kind = self.kind_for_layer(layer)
        return self.layer_kinds[kind] if kind is not None else LayerKind()

    def layer_entry(self, table: str, layer: int):
        """The layer's entry in `model.rope_layers` or `model.position_layers` (keyed by int or its text)."""
        entries = getattr(self, table)
        return entries.get(layer) or entries.get(str(layer))

    def layer_position(self, layer: int) -> tuple[Optional[list], str]:
        """The position list that applies to the layer in place of `model.position` (its own, else its kind's;
        None: `model.position`) and the key it was set at."""
        own = self.layer_entry("position_layers", layer)
        if own is not None:
            return own, f"model.position_layers.{layer}"
        return self.layer_kind(layer).position, f"model.layer_kinds.{self.kind_for_layer(layer)}.position"

    def rope_for_layer(self, layer: int) -> RopeConfig:
        """`model.rope` (with `model.position`'s RoPE keys), then the layer kind's RoPE keys, then the
        layer's `model.rope_layers` entry or the rotation entry of its `model.position_layers` list."""
        kind = self.kind_for_layer(layer)
        own = self.layer_entry("position_layers", layer)
        overrides = [(f"model.layer_kinds.{kind}.rope", self.layer_kind(layer).rope_override()),
                     (f"model.rope_layers.{layer}", self.layer_entry("rope_layers", layer)),
                     (f"model.position_layers.{layer}", None if own is None else
                      rope_overlay(parse_position(own, f"model.position_layers.{layer}")))]
        rope = self.rope
        for key, override in overrides:
            if override:
                rope = _lay_over(rope, override, key)
        return rope

    def positions_for_layer(self, layer: int) -> list[Position]:
        """The layer's position encodings (`ropelab.config.position`), its rotation first: its
        `model.position_layers` list, else its kind's, else `model.position` (or what `model.rope` alone
        spells); NoPE where the layer's RoPE rotates no channel."""
        rotary_dims = self.rope_for_layer(layer).resolve_dims(self.head_size)
        own, key = self.layer_position(layer)
        if own is not None:
            entries = parse_position(own, key)
        elif self.position is not None:
            entries = parse_position(self.position)
        else:
            return default_position(rotary_dims)
        if not rotary_dims:
            entries = default_position(0) + [entry for entry in entries if entry.type.channel != "rotation"]
        return entries

    def validate(self) -> None:
        check_ints("model", self, ("n_layer", "d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "max_seq_len",
                                   "vocab_size"))
        if self.head_dim is None and self.d_model % self.n_head:
            raise ConfigError(
                f"model.n_head={self.n_head}: must divide model.d_model={self.d_model} (or set model.head_dim)"
            )
        if self.n_head % self.kv_heads:
            raise ConfigError(f"model.n_kv_head={self.n_kv_head}: must divide model.n_head={self.n_head}")
        check_float("model.norm_eps", self.norm_eps, f"[{FLOAT32_TINY!r}, inf)", "smaller rounds to 0 in float32")
        check_float("model.init_std", self.init_std, "(0, 1]")
        if self.layer_pattern is not None or self.layer_kinds:
            check_pattern(self.layer_pattern, self.layer_kinds, self.n_layer)
            for name, kind in self.layer_kinds.items():
                kind.validate(f"model.layer_kinds.{name}")
        for index, override in self._layer_entries("rope_layers", "{3: {fraction: 0}}").items():
            if override is not None and not isinstance(override, dict):
                raise ConfigError(f"model.rope_layers.{index}={quoted(override)}: must be a mapping of model.rope "
                                  "keys, e.g. {fraction: 0}")
        for index, entries in self._layer_entries("position_layers", "{3: [{type: alibi}]}").items():
            if self.layer_entry("rope_layers", index):
                raise ConfigError(f"model.position_layers.{index}: set model.rope_layers.{index} or model.position_layers."
                                  f"{index}, not both (the list's rotation entry takes the RoPE keys)")
            parse_position(entries, f"model.position_layers.{index}")
        overridden = {int(layer) for layer, override in self.rope_layers.items() if override}
        overridden |= {int(layer) for layer in self.position_layers}
        overridden |= {layer for layer in range(self.n_layer) if self.layer_kind(layer).rope_override()}
        layers = set(overridden)
        plain = next((i for i in range(self.n_layer) if i not in overridden), None)
        if plain is not None:  # the layers without an override share model.rope: one stands for all
            layers.add(plain)
        for layer in sorted(layers):
            key = "model.rope" if layer not in overridden else self._rope_key(layer)
            rope = self.rope_for_layer(layer)
            rope.validate(self.head_size, key)
            if rope.has_plan:
                rope.validate_plan(self.head_size, key, self.kv_heads)
        lists = [parse_position(self.position)] if self.position is not None else []
        lists += [parse_position(kind.position, f"model.layer_kinds.{name}.position")
                  for name, kind in self.layer_kinds.items() if kind.position is not None]
        lists += [parse_position(entries, f"model.position_layers.{layer}")
                  for layer, entries in self.position_layers.items()]
        for entry in (entry for entries in lists for entry in entries):
            entry.spec.validate(entry.key, self.head_size, self.n_head)
        if lists:
            for layer in range(self.n_layer):
                rotation = self.positions_for_layer(layer)[0]
                if rotation.type.extrapolation and self.rope_for_layer(layer).scaling is not None:
                    raise ConfigError(f"{rotation.key}: type {rotation.type.name} takes no model.rope.scaling "
                                      f"(layer {layer}): {rotation.type.extrapolation}")
        for layer in range(self.n_layer):
            temperature = self.layer_kind(layer).temperature
            if temperature is None:
                continue
            where = f"model.layer_kinds.{self.kind_for_layer(layer)}.temperature"
            temperature.validate(where)
            rotated = self.rope_for_layer(layer).resolve_dims(self.head_size)
            if rotated:
                raise ConfigError(f"{where}: only for NoPE layers (Llama 4 scales the queries of the layers without "
                                  f"rotation), but layer {layer} rotates {rotated} channels; set rope: none")
        if self.mla is not None:
            self.mla.validate(self)

    def check_windows(self, seq_len: int) -> None:
        """Each windowed layer kind's window fits the longest training window `seq_len` (data.seq_len, or
        its longest phase): a larger one would be full attention under another name."""
        for name, kind in self.layer_kinds.items():
            if kind.window is not None and kind.window > seq_len and name in (self.layer_pattern or ""):
                raise ConfigError(f"model.layer_kinds.{name}.window={kind.window}: larger than the longest training "
                                  f"window data.seq_len={seq_len}; use a window of at most {seq_len} tokens or "
                                  "attention: full")

    def _layer_entries(self, table: str, example: str) -> dict:
        """`model.rope_layers` or `model.position_layers` by layer index: whole numbers in range, each once."""
        keys, entries = {}, {}
        for layer, value in getattr(self, table).items():
            index = _layer_index(layer)
            if index is None or not 0 <= index < self.n_layer:
                raise ConfigError(f"model.{table}.{quoted(layer)}: a layer index must be a whole number in "
                                  f"[0, {self.n_layer}), e.g. model.{table}={example}")
            if index in keys:
                raise ConfigError(f"model.{table}: layer {index} is given twice (as {quoted(keys[index])} "
                                  f"and {quoted(layer)})")
            keys[index], entries[index] = layer, value
        return entries

    def _rope_key(self, layer: int) -> str:
        if self.layer_entry("position_layers", layer) is not None:
            return f"model.position_layers.{layer}"
        if self.layer_entry("rope_layers", layer):
            return f"model.rope_layers.{layer}"
        return f"model.layer_kinds.{self.kind_for_layer(layer)}.rope"

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ConfigError(f"preset={quoted(name)}: unknown; choose one of {', '.join(MODEL_PRESETS)}")
        cfg = copy.deepcopy(MODEL_PRESETS[name])
        return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _llama(name, n_layer, d_model, n_head, n_kv_head, d_ff, vocab, tie, theta, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=vocab, n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=n_kv_head,
        d_ff=d_ff, tie_embeddings=tie, rope=RopeConfig(fraction=1.0, theta=theta), **kw,
    )


# Published shapes: Llama-3.2-1B and Llama-3.1-8B (Meta's config.json), Pythia-1B (EleutherAI's
# config.json). `pythia-1b-released` is the partial-RoPE seed's released GPT-NeoX config for its
# "Pythia-1B" runs: sequential blocks, RMSNorm, SwiGLU, no biases, 8 heads of 256, untied.
MODEL_PRESETS: dict[str, ModelConfig] = {
    # CPU-sized: head_dim 64 like Llama-3.2-1B, so the seed's fractions map to 0/2/6/16/32/48/64 dims.
    "tiny-llama": _llama("tiny-llama", 4, 128, 2, 1, 384, None, True, 10_000.0, max_seq_len=8192),
    "tiny-pythia": ModelConfig(
        name="tiny-pythia", n_layer=4, d_model=256, n_head=4, d_ff=1024, block="parallel", norm="layernorm",
        mlp="gelu", attn_bias=True, mlp_bias=True, max_seq_len=8192, rope=RopeConfig(fraction=0.25),
    ),
    "llama-3.2-1b": _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128_256, True, 500_000.0),
    "llama-3.1-8b": _llama("llama-3.1-8b", 32, 4096, 32, 8, 14_336, 128_256, False, 500_000.0),
    "llama-8b-36l": _llama("llama-8b-36l", 36, 4096, 32, 8, 14_336, 128_256, False, 500_000.0),
    "pythia-1b": ModelConfig(
        name="pythia-1b", vocab_size=50_304, n_layer=16, d_model=2048, n_head=8, d_ff=8192, block="parallel",
        norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True, max_seq_len=2048,
        rope=RopeConfig(fraction=0.25),
    ),
    "pythia-1b-released": ModelConfig(
        name="pythia-1b-released", vocab_size=50_304, n_layer=16, d_model=2048, n_head=8, d_ff=8192,
        max_seq_len=8192, rope=RopeConfig(fraction=0.25),
    ),
    # The distillation seed's student, MobileLLM-Pro 1B as publicly summarised: 30 layers, d_model
    # 1280, 20 query / 4 KV heads of 64, Llama-4 vocabulary (202,048), tied. d_ff 6144 is our
    # assumption: with it the model has the reported ~1.08B parameters.
    "mobilellm-pro-1b": _llama("mobilellm-pro-1b", 30, 1280, 20, 4, 6144, 202_048, True, 10_000.0, max_seq_len=131_072),
}
# Released hybrid layouts (Llama 4, SmolLM3, Command A, Gemma 3 and 4): `ropelab.config.layout_presets`.
MODEL_PRESETS.update({name: from_dict(ModelConfig, spec, name) for name, spec in LAYOUT_PRESETS.items()})
