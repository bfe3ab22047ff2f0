"""Position encodings as a registry (`model.position`): each method is a `PositionType` found by its
`type` tag, with a dataclass of its own keys and the capabilities it declares, so that every path
(attention, the KV cache, kernels, export, extrapolation, memory, the probe) asks the method instead of
assuming RoPE. Torch-free; the modules that compute them are in `ropelab.position`.

A layer's setting is an ordered list of specs:

    model:
      position: [{type: rope, fraction: 0.25}, {type: alibi}]   # a quarter of the channels rotate, plus ALiBi
      position: [{type: fope, trained_length: 256}]              # FoPE (arXiv 2412.17739)
      position: [{type: alibi}]                                  # no rotation, ALiBi alone

At most one entry transforms queries and keys (`channel` "rotation": rope, nope, fope); its RoPE keys
are laid over `model.rope` (a list without one is NoPE), so `model.rope`, `model.rope_layers` and
`model.layer_kinds.*.rope` keep working: they spell a one-element list ([{type: rope, ...}], or
[{type: nope}] where no channel rotates), and they still override the rotation per kind and per layer.
A layer kind (`model.layer_kinds.<kind>.position`) or a single layer (`model.position_layers`, keyed
by layer index as `model.rope_layers` is) may replace the whole list (`ModelConfig.positions_for_layer`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ropelab.config.checks import check_float, check_ints
from ropelab.config.coerce import from_dict
from ropelab.config.rope import RopeConfig
from ropelab.errors import ConfigError

CHANNELS = ("rotation", "score_bias", "attention")
CACHED_TENSORS = ("keys", "values")
NOPE_KEYS = {"fraction": 0.0, "rotary_dims": None, "scaling": None}  # the RoPE keys of a layer rotating nothing


@dataclass(frozen=True)
class KVState:
    """What a KV cache must hold per token and layer for a method: `tensors`, each a vector of head_dim
    numbers per KV head (keys, values); `rotated_keys`: the keys are held after the method's q/k
    transform (so a decode never transforms them again); `extra_per_head`: further numbers per token and
    KV head (a method carrying per-token state; none registered yet). In the cache's dtype."""

    tensors: tuple[str, ...] = CACHED_TENSORS
    rotated_keys: bool = False
    extra_per_head: int = 0

    def numbers_per_token(self, kv_heads: int, head_dim: int) -> int:
        return kv_heads * (len(self.tensors) * head_dim + self.extra_per_head)


def layer_kv_state(entries: list["Position"]) -> KVState:
    """What a KV cache holds for a layer with these entries: the union of their tensors, their extra state
    summed, keys rotated where any entry rotates them."""
    states = [entry.type.kv_cache for entry in entries]
    tensors = tuple(name for name in CACHED_TENSORS if any(name in state.tensors for state in states))
    return KVState(tensors, any(state.rotated_keys for state in states), sum(state.extra_per_head for state in states))


@dataclass(frozen=True)
class PositionType:
    """One registered method: its keys and what it declares about itself.

    `channel`: how it enters attention: ``rotation`` (a transform of q and k before the scores),
    ``score_bias`` (a term added to the scores, from the distance of query and key token indices) or ``attention``
    (it replaces attention itself). `rope_keys`: the entry also takes `model.rope` keys (its rotation).
    `learned`: it has trained parameters (then one module per layer, no weight decay, gradients on
    every path). `fast_kernels`: its transform is cos/sin of position x frequency, so the C, Triton
    and in-place rotations apply. `kv_cache`: what a KV cache holds for it (`KVState`; the memory
    calculator counts its bytes). `excludes`: the channels and types it cannot share a list with
    (`parse_position` refuses the pair in one line). `extrapolation`: None
    where RoPE scaling (linear, NTK, YaRN, ...) applies to it, else why `eval extrapolation` refuses.
    `hf_native`: an HF class may compute it (export still checks the round trip). `any_length`: it is
    meant to run past the model's max_seq_len as it is (long-context evaluation lets it)."""

    name: str
    label: str  # as reports write it
    spec: type
    channel: str
    summary: str
    rope_keys: bool = False
    learned: bool = False
    fast_kernels: bool = False
    kv_cache: KVState = KVState()
    excludes: tuple[str, ...] = ()
    extrapolation: Optional[str] = None
    hf_native: bool = False
    any_length: bool = False


POSITION_TYPES: dict[str, PositionType] = {}


def register_position(position_type: PositionType) -> PositionType:
    if position_type.channel not in CHANNELS:
        raise ValueError(f"{position_type.name}: channel must be one of {', '.join(CHANNELS)}")
    POSITION_TYPES[position_type.name] = position_type
    return position_type


@dataclass
class NoKeys:
    """A method without keys of its own."""

    def validate(self, key: str, head_dim: int, n_head: int) -> None:
        pass


@dataclass
class AlibiSpec:
    """ALiBi (Press et al. 2022): head h adds -slope_h * (query index - key index) to its scores,
    slope_h = 2^(-max_bias * (h + 1) / n_head) (the paper's geometric slopes for 8 heads: 1/2 ... 1/256)."""

    max_bias: float = 8.0

    def validate(self, key: str, head_dim: int, n_head: int) -> None:
        check_float(f"{key}.max_bias", self.max_bias, "(0, 64]")


@dataclass
class FopeSpec:
    """FoPE (Hua et al., arXiv 2412.17739): RoPE whose frequencies turning less than once in
    `trained_length` tokens are clipped to 0, and whose every rotated dimension is a Fourier series:
    cos and sin of all the layer's frequencies mixed by learned (r/2, r/2) matrices, initialised to the
    identity plus N(0, coefficient_std^2) noise."""

    trained_length: Optional[int] = None
    coefficient_std: float = 0.1

    def validate(self, key: str, head_dim: int, n_head: int) -> None:
        if self.trained_length is None:
            raise ConfigError(f"{key}.trained_length: required for fope (the training length in tokens: frequencies "
                              "turning less than once in it are clipped to 0)")
        check_ints(key, self, ("trained_length",))
        check_float(f"{key}.coefficient_std", self.coefficient_std, "[0, 1]")


ROTATED = KVState(rotated_keys=True)
register_position(PositionType("rope", "RoPE", NoKeys, "rotation", "rotary position embedding (model.rope keys)",
                               rope_keys=True, fast_kernels=True, hf_native=True, kv_cache=ROTATED))
register_position(PositionType("nope", "NoPE", NoKeys, "rotation", "no position encoding: nothing rotates",
                               hf_native=True, extrapolation="a NoPE layer has no frequency to scale"))
register_position(PositionType("fope", "FoPE", FopeSpec, "rotation", "Fourier position embedding (RoPE keys too)",
                               rope_keys=True, learned=True, kv_cache=ROTATED, extrapolation=(
                                   "FoPE clips frequencies at its trained length and mixes them by learned "
                                   "coefficients; RoPE scaling would move what it clips")))
register_position(PositionType("alibi", "ALiBi", AlibiSpec, "score_bias", "attention with linear biases",
                               any_length=True,  # plain keys and values: the bias comes from token indices
                               extrapolation="ALiBi has no frequency to scale; it runs at any length as it is"))


@dataclass
class Position:
    """One parsed entry: its type, its own keys, and the RoPE keys it lays over `model.rope`."""

    type: PositionType
    spec: object
    rope: dict
    key: str = "model.rope"  # where it was set


def parse_position(entries: object, key: str = "model.position") -> list[Position]:
    """`model.position` as a list of `Position`, or a one-line ConfigError naming the entry and what is allowed."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{key}={entries!r:.80}: must be a non-empty list of {{type: ...}} entries, e.g. "
                          "[{type: rope, fraction: 0.25}, {type: alibi}]")
    parsed, seen = [], {}
    rope_fields = {field.name for field in dataclasses.fields(RopeConfig)}
    for index, entry in enumerate(entries):
        where = f"{key}[{index}]"
        name = entry.get("type") if isinstance(entry, dict) else None
        if name not in POSITION_TYPES:
            raise ConfigError(f"{where}.type={name!r:.80}: must be one of {', '.join(POSITION_TYPES)}")
        kind = POSITION_TYPES[name]
        if kind.channel in seen or name in {p.type.name for p in parsed}:
            raise ConfigError(f"{where}: a second {kind.channel} entry ({name} after {seen.get(kind.channel, name)}); "
                              f"a layer has at most one of each channel")
        seen[kind.channel] = name
        own = {field.name for field in dataclasses.fields(kind.spec)}
        keys = {k: v for k, v in entry.items() if k != "type"}
        rope = {k: v for k, v in keys.items() if kind.rope_keys and k in rope_fields and k not in own}
        unknown = sorted(set(keys) - own - set(rope), key=str)
        if unknown:
            allowed = sorted(own | (rope_fields if kind.rope_keys else set()))
            raise ConfigError(f"{where}.{unknown[0]}: unknown key for type {name}; allowed: "
                              f"{', '.join(allowed) or 'none'}")
        spec = from_dict(kind.spec, {k: v for k, v in keys.items() if k in own}, where)
        parsed.append(Position(kind, spec, NOPE_KEYS if name == "nope" else rope, where))
    check_exclusions(parsed)
    if "rotation" not in seen:
        parsed.insert(0, Position(POSITION_TYPES["nope"], NoKeys(), NOPE_KEYS, key))
    return sorted(parsed, key=lambda entry: entry.type.channel != "rotation")  # the rotation first, else in order


def check_exclusions(entries: list[Position]) -> None:
    """A one-line ConfigError naming both entries where one's type `excludes` the other's type or channel."""
    for first in entries:
        for second in entries:
            barred = {second.type.name, second.type.channel} & set(first.type.excludes)
            if first is not second and barred:
                raise ConfigError(f"{second.key} ({second.type.name}): cannot share a list with {first.key} "
                                  f"({first.type.name}), which excludes {barred.pop()}")


def rope_overlay(entries: list[Position]) -> dict:
    """The RoPE keys the rotation entry lays over `model.rope` (a fraction replaces a channel count)."""
    rotation = next(p for p in entries if p.type.channel == "rotation")
    keys = dict(rotation.rope)
    if "fraction" in keys and "rotary_dims" not in keys:
        keys["rotary_dims"] = None
    return keys


def default_position(rotary_dims: int) -> list[Position]:
    """What `model.rope` alone spells: [rope], or [nope] where no channel rotates."""
    name = "rope" if rotary_dims else "nope"
    return [Position(POSITION_TYPES[name], NoKeys(), {} if rotary_dims else NOPE_KEYS)]


__all__ = ["CACHED_TENSORS", "CHANNELS", "NOPE_KEYS", "POSITION_TYPES", "AlibiSpec", "FopeSpec", "KVState", "NoKeys",
           "Position", "PositionType", "check_exclusions", "default_position", "layer_kv_state", "parse_position",
           "register_position", "rope_overlay"]
