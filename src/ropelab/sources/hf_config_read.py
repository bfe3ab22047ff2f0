"""Reading a transformers config (Llama, Qwen2, Qwen3, GPT-NeoX) into a ropelab `ModelConfig`.

  arch_of(hf_config)               its architecture (`ropelab.sources.hf_archs.ARCHS`), or a ValueError
  model_config_from_hf(hf_config)  the exactly equivalent ModelConfig, or a ValueError saying why none is

RoPE is read from transformers 5 `rope_parameters` or the 4.x flat fields (`rope_theta`, `rope_scaling`,
GPT-NeoX's `rotary_emb_base` / `rotary_pct`). HF's rope types linear, dynamic, yarn, llama3 and
longrope become `rope.scaling`; HF's dynamic NTK grows from max_position_embeddings, so that is the
original context it imports with.
"""

from __future__ import annotations

from ropelab.config import ModelConfig, RopeConfig, RopeScalingConfig
from ropelab.sources.hf_archs import ARCHS, COMMON_FIELDS, HF_FIELD_NAMES, SCALING_FIELDS, Arch


def arch_of(hf_config) -> Arch:
    """The architecture of a transformers config, or a ValueError listing the supported ones."""
    arch = ARCHS.get(getattr(hf_config, "model_type", None))
    if arch is None:
        supported = ", ".join(a.model_class for a in ARCHS.values())
        model_type = getattr(hf_config, "model_type", None)
        raise ValueError(f"model_type={model_type!r}: not convertible; supported: {supported}")
    return arch


def _read_rope(hf_config) -> tuple[float, float, RopeScalingConfig | None]:
    """(theta, partial rotary fraction, scaling) from a transformers 5 `rope_parameters` or 4.x flat
    fields (`rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # nested per layer type
        distinct = {repr(sorted(v.items())) for v in params.values()}
        if len(distinct) > 1:
            raise ValueError(f"{hf_config.model_type}: RoPE differs between layer types; ropelab has one setting")
        params = next(iter(params.values()))
    scaling = getattr(hf_config, "rope_scaling", None) or {}  # transformers 4.x
    rope_type = params.get("rope_type", params.get("type")) or scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and rope_type not in SCALING_FIELDS:
        raise ValueError(f"{hf_config.model_type}: rope_type={rope_type!r} has no ropelab equivalent "
                         f"(ropelab reads default, {', '.join(SCALING_FIELDS)})")
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


def model_config_from_hf(hf_config) -> ModelConfig:
    """The ropelab ModelConfig of a Llama, Qwen2, Qwen3 or GPT-NeoX transformers config."""
    arch = arch_of(hf_config)
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    if get("hidden_act") != arch.act:
        raise ValueError(
            f"{arch.model_class}: hidden_act={get('hidden_act')!r}; ropelab's {arch.mlp} uses {arch.act!r}"
        )
    if "sliding_attention" in (get("layer_types") or []):
        raise ValueError(f"{arch.model_class}: sliding-window layers have no ropelab equivalent")
    theta, pct, scaling = _read_rope(hf_config)
    C, H = hf_config.hidden_size, hf_config.num_attention_heads
    D = C // H if arch.fused_qkv else (get("head_dim") or C // H)
    rotary_dims = int(D * pct) if arch.partial_rope else D
    if rotary_dims % 2:
        raise ValueError(
            f"{arch.model_class}: {rotary_dims} rotary channels (head_dim {D} x {pct}); ropelab needs an even count"
        )
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
        rope=RopeConfig(fraction=rotary_dims / D, rotary_dims=rotary_dims, theta=theta, scaling=scaling),
        **flags,
    )


__all__ = ["arch_of", "model_config_from_hf"]
