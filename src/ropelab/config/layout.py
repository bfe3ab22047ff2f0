"""Per-layer positional layout: which RoPE, which attention window and which query temperature each
layer gets (`LayerKind`), named by one character and repeated as a pattern (`model.layer_pattern`).

Released models mix layer kinds: Llama 4 makes every fourth layer NoPE with full attention and a query
temperature, its other layers chunked RoPE; SmolLM3 makes every fourth layer NoPE; Gemma 3 alternates
five sliding-window layers at theta 10k with one full-attention layer at theta 1M. In ropelab:

    model:
      layer_pattern: LLLG          # repeated to n_layer; its length must divide n_layer
      layer_kinds:
        L: {attention: sliding, window: 1024}
        G: {rope: none, temperature: {floor_scale: 8192, attn_scale: 0.1}}

A kind's `rope` holds RoPE keys laid over `model.rope` (like a `model.rope_layers` entry, which still
applies on top, per layer), or ``none`` for a NoPE layer. A pattern as long as `n_layer` sets every
layer directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ropelab.config.checks import check_float, check_ints
from ropelab.config.position import parse_position, rope_overlay
from ropelab.errors import QUOTE_LIMIT, ConfigError, bounded, quoted

@dataclass
class QueryTemperature:
    """Llama 4's attention temperature for NoPE layers (HF `llama4`, `attn_temperature_tuning`): the
    query at position p is multiplied by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``,
    so attention sharpens slowly beyond `floor_scale` tokens where no rotation separates positions."""

    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def validate(self, key: str) -> None:
        check_float(f"{key}.floor_scale", self.floor_scale, "(0, inf)")
        check_float(f"{key}.attn_scale", self.attn_scale, "[0, inf)")


@dataclass
class LayerKind:
    """One kind of layer in `model.layer_kinds`.

    `rope`: RoPE keys over `model.rope` (``{theta: 1000000}``, ``{fraction: 0.25, style: truncate}``),
    ``none`` for NoPE, or unset to use `model.rope` as it is.
    `attention`: ``full``; ``sliding`` (each query sees itself and the `window` - 1 tokens before it,
    HF's `sliding_window`); ``chunked`` (each query sees the earlier tokens of its own block of `window`
    tokens, HF's `attention_chunk_size`). Windows combine with the document mask.
    `temperature`: Llama 4's NoPE query temperature; only on a NoPE kind.
    `position`: the kind's own list of position encodings in place of `model.position`
    (`ropelab.config.position`, e.g. ``[{type: alibi}]``); its rotation entry's RoPE keys are the kind's
    `rope` keys, laid over `model.rope` as `model.position` left it, so a kind sets one of the two."""

    rope: Optional[dict | str] = None
    attention: Literal["full", "sliding", "chunked"] = "full"
    window: Optional[int] = None
    temperature: Optional[QueryTemperature] = None
    position: Optional[list] = None

    @property
    def nope(self) -> bool:
        return self.rope == "none"

    def rope_override(self) -> dict:
        """The RoPE keys this kind lays over `model.rope`; for ``none``, no rotated channel and no scaling
        (whatever `model.rope` sets for the RoPE layers)."""
        if self.position is not None:
            return rope_overlay(parse_position(self.position, "model.layer_kinds.position"))
        if self.rope is None:
            return {}
        return {"fraction": 0.0, "rotary_dims": None, "scaling": None} if self.nope else dict(self.rope)

    def validate(self, key: str) -> None:
        if self.position is not None:
            if self.rope is not None:
                raise ConfigError(f"{key}: set rope or position, not both (a position list's rotation entry takes "
                                  "the RoPE keys)")
            parse_position(self.position, f"{key}.position")
        if isinstance(self.rope, str) and self.rope != "none":
            raise ConfigError(f"{key}.rope={quoted(self.rope)}: must be a mapping of model.rope keys or 'none' (NoPE)")
        if self.attention == "full":
            if self.window is not None:
                raise ConfigError(f"{key}.window={self.window}: only for attention: sliding or chunked "
                                  "(this kind has full attention)")
        elif self.window is None:
            raise ConfigError(f"{key}.window: required for attention: {self.attention} (tokens a query sees)")
        check_ints(key, self, ("window",))


def check_pattern(pattern: str, kinds: dict, n_layer: int) -> None:
    """`model.layer_pattern` names only kinds of `model.layer_kinds` and repeats a whole number of times."""
    for name in kinds:
        if not isinstance(name, str):
            raise ConfigError(f"model.layer_kinds.{quoted(name)}: a layer kind is named by one character, a string "
                              "(in YAML, quote a digit: '1')")
        if len(name) != 1:
            raise ConfigError(f"model.layer_kinds.{bounded(name, QUOTE_LIMIT)}: a layer kind is named by one character")
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"model.layer_pattern={quoted(pattern)}: must be a non-empty string, one character per "
                          "layer kind (e.g. 'LLLG')")
    if n_layer % len(pattern):
        raise ConfigError(f"model.layer_pattern={quoted(pattern)}: its length {len(pattern)} must divide "
                          f"model.n_layer={n_layer}")
    unknown = sorted(set(pattern) - set(kinds))
    if unknown:
        raise ConfigError(f"model.layer_pattern={quoted(pattern)}: layer kind {unknown[0]!r} is not in model.layer_kinds "
                          f"(defined: {', '.join(sorted(kinds)) or 'none'})")
