"""Reading a transformers config (Llama, SmolLM3, Qwen2, Qwen3, GPT-NeoX) into a ropelab `ModelConfig`.

  arch_of(hf_config)               its architecture (`ropelab.sources.hf_archs.ARCHS`), or a ConfigError
  model_config_from_hf(hf_config)  the exactly equivalent ModelConfig, or a ConfigError saying why none is

RoPE is read from transformers 5 `rope_parameters` or the 4.x flat fields (`rope_theta`, `rope_scaling`,
GPT-NeoX's `rotary_emb_base` / `rotary_pct`). HF's rope types linear, dynamic, yarn, llama3 and
longrope become `rope.scaling`; HF's dynamic NTK grows from max_position_embeddings, so that is the
original context it imports with. `rope_parameters` nested by layer type ({"full_attention": {...},
"sliding_attention": {...}}) read as one setting when the types agree; none of the classes ropelab
converts gives layer types their own RoPE, so a difference is refused.

NoPE layers (SmolLM3's `no_rope_layers`, 1 RoPE and 0 NoPE per layer, or `no_rope_layer_interval`)
and sliding-window layers (`layer_types` "sliding_attention" with `sliding_window`: SmolLM3, Qwen2,
Qwen3) become layer kinds (`model.layer_kinds`), named R (RoPE), N (NoPE), S (RoPE, sliding window)
and W (NoPE, sliding window), in the shortest pattern that repeats over the layers (as long as the
model when none does); a model of RoPE layers over the whole context has none.

Refusals are one-line ConfigErrors (a ValueError), naming the field or the missing piece.
"""

from __future__ import annotations

import dataclasses

from ropelab.config import ConfigError, LayerKind, ModelConfig, RopeConfig, RopeScalingConfig
from ropelab.sources.hf_archs import (ARCHS, COMMON_FIELDS, HF_FIELD_NAMES, LAYER_TYPES, REFUSED, SCALING_FIELDS,
                                     Arch)

_KIND_NAMES = {(True, False): "R", (False, False): "N", (True, True): "S", (False, True): "W"}


def arch_of(hf_config) -> Arch:
    """The architecture of a transformers config, or a ConfigError naming what ropelab lacks for it
    (`REFUSED`) or listing the supported ones."""
    model_type = getattr(hf_config, "model_type", None)
    arch = ARCHS.get(model_type)
    if arch is None:
        supported = ", ".join(a.model_class for a in ARCHS.values())
        if model_type in REFUSED:
            raise ConfigError(f"model_type={model_type!r}: not convertible: ropelab lacks {REFUSED[model_type]}; "
                              f"supported: {supported}")
        raise ConfigError(f"model_type={model_type!r}: not convertible; supported: {supported}")
    return arch


def _rope_parameters(hf_config) -> dict:
    """transformers 5 `rope_parameters`, one dict; nested per layer type only where the types agree."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    nested = {k: v for k, v in params.items() if k in set(getattr(hf_config, "layer_types", None) or ())}
    if not nested and params and all(isinstance(v, dict) for v in params.values()):
        nested = params  # nested under layer types the config does not declare
    if not nested:
        return params
    if len({repr(sorted(v.items())) for v in nested.values()}) > 1:
        each = "; ".join(f"{k}: {v}" for k, v in sorted(nested.items()))
        raise ConfigError(f"{hf_config.model_type}: rope_parameters differ between layer types ({each}), but "
                          f"{ARCHS[hf_config.model_type].model_class} applies one RoPE to every layer")
    return next(iter(nested.values()))


def _read_rope(hf_config) -> tuple[float, float, RopeScalingConfig | None]:
    """(theta, partial rotary fraction, scaling) from a transformers 5 `rope_parameters` or 4.x flat
    fields (`rope_scaling`)."""
    params = _rope_parameters(hf_config)
    scaling = getattr(hf_config, "rope_scaling", None) or {}  # transformers 4.x
    rope_type = params.get("rope_type", params.get("type")) or scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and rope_type not in SCALING_FIELDS:
        raise ConfigError(f"{hf_config.model_type}: rope_type={rope_type!r} has no ropelab equivalent "
                          f"(ropelab reads default, {', '.join(SCALING_FIELDS)})")
    read = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings",
            *(HF_FIELD_NAMES.get(name, name) for name in SCALING_FIELDS.get(rope_type, ()))}
    flat_scaling = {key for key, value in scaling.items() if not isinstance(value, dict)}  # 5.x may nest it
    unknown = sorted((set(params) | flat_scaling) - read)
    if unknown:  # a position setting ropelab would drop: its model would compute something else
        raise ConfigError(f"{hf_config.model_type}: rope parameter {unknown[0]!r} (rope_type={rope_type}) has no "
                          f"ropelab equivalent; ropelab reads {', '.join(sorted(read))}")
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None)
    theta = theta or getattr(hf_config, "rotary_emb_base", None)  # transformers 4.x GPT-NeoX
    pct = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if pct is None:
        pct = getattr(hf_config, "rotary_pct", 1.0)
    extension = None if rope_type == "default" else _read_scaling(rope_type, scaling | params, hf_config)
    return float(theta if theta is not None else 10_000.0), float(pct), extension


def _read_scaling(rope_type: str, fields: dict, hf_config) -> RopeScalingConfig:
    """The RopeScalingConfig of an HF rope type, with the defaults HF's own functions fill in."""
    values = {name: fields[HF_FIELD_NAMES.get(name, name)] for name in SCALING_FIELDS[rope_type]
              if fields.get(HF_FIELD_NAMES.get(name, name)) is not None}
    max_positions = hf_config.max_position_embeddings
    if rope_type == "dynamic":
        values["original_max_position"] = max_positions
    elif "original_max_position" not in values:
        values["original_max_position"] = getattr(hf_config, "original_max_position_embeddings", None) or max_positions
    if rope_type in ("yarn", "longrope") and "factor" not in values:  # HF: the ratio of the two lengths
        values["factor"] = max_positions / values["original_max_position"]
    for beta in ("beta_fast", "beta_slow"):  # HF reads `beta or default`: 0 is the default too
        if not values.get(beta, True):
            del values[beta]
    values["factor"] = float(values["factor"]) if "factor" in values else None
    values["original_max_position"] = int(values["original_max_position"])
    return RopeScalingConfig(method=rope_type, **values)


def _rotating_layers(hf_config, arch: Arch) -> list[bool]:
    """RoPE (True) or NoPE per layer."""
    n_layer = hf_config.num_hidden_layers
    if not arch.nope_layers:
        return [True] * n_layer
    flags = getattr(hf_config, "no_rope_layers", None)
    if not flags:  # SmolLM3's default: a NoPE layer every `no_rope_layer_interval` layers
        interval = getattr(hf_config, "no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(n_layer)]
    if len(flags) < n_layer:
        raise ConfigError(f"{arch.model_class}: no_rope_layers has {len(flags)} entries for {n_layer} layers")
    return [bool(flag) for flag in flags[:n_layer]]


def _sliding_layers(hf_config, arch: Arch) -> tuple[list[bool], int | None]:
    """(sliding or not per layer, the window)."""
    n_layer, cls = hf_config.num_hidden_layers, arch.model_class
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * n_layer)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n_layer:
        raise ConfigError(f"{cls}: layer_types={unknown or types}: ropelab reads one of {', '.join(LAYER_TYPES)} "
                          f"per layer ({n_layer})")
    sliding = [t == "sliding_attention" for t in types]
    window = getattr(hf_config, "sliding_window", None)
    if any(sliding) and not arch.sliding:
        raise ConfigError(f"{cls}: layer_types mark sliding-window layers, but {cls} attends to every earlier token")
    if any(sliding) and (window is None or getattr(hf_config, "use_sliding_window", True) is False):
        raise ConfigError(f"{cls}: layer_types mark sliding-window layers, but sliding_window={window} and "
                          f"use_sliding_window={getattr(hf_config, 'use_sliding_window', None)}; set both")
    return sliding, window if any(sliding) else None


def _shortest_period(names: list[str]) -> str:
    period = next(p for p in range(1, len(names) + 1)
                  if len(names) % p == 0 and all(name == names[i % p] for i, name in enumerate(names)))
    return "".join(names[:period])


def _layout_from_hf(hf_config, arch: Arch) -> tuple[str | None, dict]:
    """(layer_pattern, layer_kinds) of `hf_config`."""
    rotating = _rotating_layers(hf_config, arch)
    sliding, window = _sliding_layers(hf_config, arch)
    if all(rotating) and not any(sliding):
        return None, {}
    kinds, names = {}, []
    for rotates, slides in zip(rotating, sliding):
        name = _KIND_NAMES[rotates, slides]
        if name not in kinds:
            kinds[name] = LayerKind(rope=None if rotates else "none", attention="sliding" if slides else "full",
                                    window=window if slides else None)
        names.append(name)
    return _shortest_period(names), kinds


def model_config_from_hf(hf_config) -> ModelConfig:
    """The ropelab ModelConfig of a Llama, SmolLM3, Qwen2, Qwen3 or GPT-NeoX transformers config."""
    arch = arch_of(hf_config)
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    if get("hidden_act") != arch.act:
        raise ConfigError(
            f"{arch.model_class}: hidden_act={get('hidden_act')!r}; ropelab's {arch.mlp} uses {arch.act!r}"
        )
    theta, pct, scaling = _read_rope(hf_config)
    C, H = hf_config.hidden_size, hf_config.num_attention_heads
    D = C // H if arch.fused_qkv else (get("head_dim") or C // H)
    if not arch.partial_rope and pct != 1.0:
        raise ConfigError(f"{arch.model_class}: partial_rotary_factor={pct:g}, but the class rotates every channel of "
                          "each head (its apply_rotary_pos_emb has no pass-through part); ropelab reads 1 only")
    rotary_dims = int(D * pct) if arch.partial_rope else D
    if rotary_dims % 2:
        raise ConfigError(
            f"{arch.model_class}: {rotary_dims} rotary channels (head_dim {D} x {pct}); ropelab needs an even count"
        )
    pattern, kinds = _layout_from_hf(hf_config, arch)
    if scaling is not None and any(kind.nope for kind in kinds.values()):
        # a NoPE layer takes no scaling (`RopeScalingConfig.validate`): the RoPE kinds carry it
        for kind in kinds.values():
            kind.rope = kind.rope if kind.nope else {"scaling": dataclasses.asdict(scaling)}
        scaling = None
    flags = {
        flag: (get(field_name, default) if field_name else default)
        for flag, (field_name, default) in (("attn_bias", arch.attn_bias), ("mlp_bias", arch.mlp_bias))
    }
    return ModelConfig(
        name=get("name_or_path") or arch.model_class,
        **{ours: get(theirs) for ours, theirs in COMMON_FIELDS.items()},
        n_kv_head=None if arch.fused_qkv else get("num_key_value_heads"),
        head_dim=D,
        block="parallel" if arch.fused_qkv and get("use_parallel_residual", True) else "sequential",
        norm=arch.norm,
        norm_eps=get(arch.eps_field),
        mlp=arch.mlp,
        qk_norm=arch.qk_norm,
        # a full RoPE names no channel count, so that a kind's `rope: none` (fraction 0) makes a layer NoPE
        rope=RopeConfig(fraction=rotary_dims / D, rotary_dims=rotary_dims if rotary_dims < D else None, theta=theta,
                        scaling=scaling),
        layer_pattern=pattern,
        layer_kinds=kinds,
        **flags,
    )


__all__ = ["arch_of", "model_config_from_hf"]
