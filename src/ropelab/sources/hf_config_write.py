"""Writing the transformers config of a ropelab model: the architecture exactly equivalent to a
`ModelConfig` (`ropelab.sources.hf_archs`), or a ValueError naming every reason there is none.

  hf_architecture(config)  the HF model_type (llama, smollm3, qwen3 or gpt_neox)
  hf_config_for(config)    the LlamaConfig, SmolLM3Config, Qwen3Config or GPTNeoXConfig

A Llama block with NoPE layers among its RoPE layers, or with sliding-window layers, is a SmolLM3
(`no_rope_layers`, `layer_types`); with QK-norm, a Qwen3 (`layer_types`; no NoPE layers). A model
without any RoPE layer stays as it was, a Llama block that rotates no channel (no native class).
RoPE is written flat (`rope_parameters` of one setting): the RoPE layers share it.

RoPE scaling (`rope.scaling`) travels as HF's rope types (transformers 5 `rope_parameters`, 4.x
`rope_scaling`): linear, dynamic, yarn, llama3 and longrope on Llama, SmolLM3 and Qwen3; GPT-NeoX exports
linear and dynamic. Static NTK (`ntk`, no HF rope type) is a change of base, so it exports as the
default rope type at the base it amounts to. HF's dynamic NTK grows from max_position_embeddings, so
a dynamic model exports with max_position_embeddings = its original_max_position.
"""

from __future__ import annotations

import math

from ropelab.config import ModelConfig, RopeConfig
from ropelab.sources.hf_archs import ARCHS, COMMON_FIELDS, HF_FIELD_NAMES, LAYER_TYPES, SCALING_FIELDS, Arch
from ropelab.sources.transformers_lib import require_transformers


def _ropes(config: ModelConfig) -> tuple[list[RopeConfig], list[int]]:
    """(the RoPE of each rotating layer, the NoPE layers); every layer's RoPE when none rotates."""
    ropes = [config.rope_for_layer(i) for i in range(config.n_layer)]
    nope = [i for i, rope in enumerate(ropes) if not rope.resolve_dims(config.head_size)]
    rotating = [rope for rope in ropes if rope.resolve_dims(config.head_size)]
    return rotating or ropes, nope if rotating else []


def _is_hybrid(config: ModelConfig) -> bool:
    """NoPE layers among RoPE layers, or sliding-window layers."""
    sliding = any(config.layer_kind(i).attention == "sliding" for i in range(config.n_layer))
    return sliding or bool(_ropes(config)[1])


def hf_architecture(config: ModelConfig) -> str:
    """The HF model_type exactly equivalent to `config`, or a ValueError listing every obstacle."""
    if config.norm == "layernorm" and config.mlp == "gelu":
        name = "gpt_neox"
    elif config.norm == "rmsnorm" and config.mlp == "swiglu":
        name = "qwen3" if config.qk_norm else "smollm3" if _is_hybrid(config) else "llama"
    else:
        raise ValueError(
            f"no Hugging Face class pairs norm={config.norm} with mlp={config.mlp} "
            "(Llama/Qwen3: rmsnorm + swiglu; GPT-NeoX: layernorm + gelu)"
        )
    arch, why = ARCHS[name], []
    if config.vocab_size is None:
        why.append("vocab_size is None (set it from the tokenizer first)")
    if config.qk_norm != arch.qk_norm:
        why.append(f"{arch.model_class} has no QK-norm but qk_norm=True")
    if config.block == "parallel" and not arch.fused_qkv:
        why.append(f"block=parallel: {arch.model_class} has sequential blocks (parallel needs layernorm + gelu)")
    for flag in ("attn_bias", "mlp_bias"):
        field_name, fixed = getattr(arch, flag)
        if field_name is None and getattr(config, flag) != fixed:
            why.append(f"{flag}={getattr(config, flag)}: {arch.model_class} always has {flag}={fixed}")
    if arch.fused_qkv and config.kv_heads != config.n_head:
        why.append(f"n_kv_head={config.kv_heads}: GPT-NeoX has no grouped-query attention")
    if (arch.fused_qkv or not arch.head_dim_field) and config.head_size * config.n_head != config.d_model:
        why.append(f"head_dim={config.head_size}: {arch.model_class} needs head_dim = d_model / n_head")
    if config.mla is not None:
        why.append(f"model.mla (rank {config.mla.rank}): no transformers class caches a latent per KV head beside "
                   "its kept RoPE pairs")
    why += _rope_obstacles(config, arch) + _layout_obstacles(config, arch)
    if why:
        raise ValueError(f"cannot export {config.name!r} as {arch.model_class}: " + "; ".join(why))
    return name


def _rope_obstacles(config: ModelConfig, arch: Arch) -> list[str]:
    (rope, *others), nope = _ropes(config)
    D, why = config.head_size, []
    if nope and not arch.nope_layers:
        why.append(f"NoPE layers {nope} among RoPE layers: {arch.model_class} rotates every layer "
                   "(SmolLM3ForCausalLM has NoPE layers, without QK-norm)")
    if any(other != rope for other in others):
        why.append("model.rope_layers, model.position_layers or model.layer_kinds give layers different RoPE settings; "
                   "HF classes give their RoPE layers one")
    rotary_dims = rope.resolve_dims(D)
    if rotary_dims and rope.layout != "half":
        why.append(f"rope.layout={rope.layout}: HF classes rotate with rotate_half (layout=half)")
    if rotary_dims < D and not arch.partial_rope:
        why.append(f"rotary_dims={rotary_dims} of head_dim={D}: {arch.model_class} rotates every channel")
    if 0 < rotary_dims < D and rope.style != "slice":
        why.append(f"rope.style={rope.style}: GPT-NeoX partial RoPE uses slice frequencies theta^(-2i/rotary_dims)")
    if rope.scaling is not None and rope.scaling.method not in arch.scalings:
        why.append(f"rope.scaling.method={rope.scaling.method}: exported natively as {arch.model_class} only for "
                   f"{', '.join(arch.scalings)}")
    return why


def _layout_obstacles(config: ModelConfig, arch: Arch) -> list[str]:
    """Why `arch` cannot hold the windows and temperatures of `config`'s layer kinds (`_rope_obstacles`:
    their RoPE)."""
    cls, why = arch.model_class, []
    kinds = {config.kind_for_layer(i): config.layer_kind(i) for i in range(config.n_layer)}
    for name, kind in kinds.items():
        if kind.attention == "chunked":
            why.append(f"model.layer_kinds.{name}: chunked attention: no class ropelab exports has it "
                       "(transformers' Llama 4 does, with mixture-of-experts MLPs)")
        if kind.temperature is not None:
            why.append(f"model.layer_kinds.{name}.temperature: no class ropelab exports scales NoPE queries "
                       "(transformers' Llama 4 does, with mixture-of-experts MLPs)")
    windows = sorted({kind.window for kind in kinds.values() if kind.attention == "sliding"})
    if windows and not arch.sliding:
        why.append(f"sliding-window layers: {cls} attends to every earlier token "
                   "(Qwen3ForCausalLM and SmolLM3ForCausalLM have sliding windows)")
    elif len(windows) > 1:
        why.append(f"sliding windows of {windows} tokens: {cls} has one sliding_window")
    return why


def _hf_layout_fields(config: ModelConfig, arch: Arch) -> dict:
    """The config fields of `arch` for the layout of `config` (which `_layout_obstacles` allows)."""
    fields = {}
    if arch.nope_layers:
        fields["no_rope_layers"] = [int(config.rope_for_layer(i).resolve_dims(config.head_size) > 0)
                                    for i in range(config.n_layer)]
    if arch.sliding:
        kinds = [config.layer_kind(i) for i in range(config.n_layer)]
        window = next((kind.window for kind in kinds if kind.attention == "sliding"), None)
        fields |= {
            "layer_types": [LAYER_TYPES[kind.attention == "sliding"] for kind in kinds],
            "use_sliding_window": window is not None,
            "sliding_window": window,
        }
    return fields


def _hf_scaling(rope: RopeConfig, rotary_dims: int) -> tuple[float, dict]:
    """(HF rope_theta, HF rope type fields) of the layer's RoPE; static NTK becomes its base."""
    scaling = rope.scaling
    if scaling is None:
        return rope.theta, {"rope_type": "default"}
    if scaling.method == "ntk":  # theta * factor^(dim/(dim-2)), dim the rotated channels (slice or full RoPE)
        return rope.theta * scaling.factor ** (rotary_dims / (rotary_dims - 2)), {"rope_type": "default"}
    fields = {HF_FIELD_NAMES.get(name, name): getattr(scaling, name) for name in SCALING_FIELDS[scaling.method]}
    return rope.theta, {"rope_type": scaling.method} | {k: v for k, v in fields.items() if v is not None}


def _rotary_pct(rotary_dims: int, head_dim: int) -> float:
    """A fraction p with int(head_dim * p) == rotary_dims, as GPT-NeoX computes its rotary channels."""
    pct = rotary_dims / head_dim
    while int(head_dim * pct) < rotary_dims:  # rounding below an integer: step up one ulp
        pct = math.nextafter(pct, 2.0)
    return pct


def _rope_kwargs(config_cls: type, arch: Arch, theta: float, pct: float, scaling: dict) -> dict:
    """RoPE keywords: transformers 5 `rope_parameters`, or the 4.x flat fields (with `rope_scaling`)."""
    if hasattr(config_cls, "rope_parameters"):
        params = scaling | {"rope_theta": theta}
        if arch.partial_rope:
            params["partial_rotary_factor"] = pct
        return {"rope_parameters": params}
    flat = {} if scaling["rope_type"] == "default" else {"rope_scaling": scaling}
    if arch.partial_rope:  # transformers 4.x GPTNeoXConfig
        return flat | {"rotary_emb_base": theta, "rotary_pct": pct}
    return flat | {"rope_theta": theta}


def hf_config_for(config: ModelConfig):
    """The transformers config (LlamaConfig, SmolLM3Config, Qwen3Config or GPTNeoXConfig) equivalent to `config`."""
    arch = ARCHS[hf_architecture(config)]
    config_cls = getattr(require_transformers("Hugging Face conversion"), arch.config_class)
    rope, D = _ropes(config)[0][0], config.head_size
    kwargs = {theirs: getattr(config, ours) for ours, theirs in COMMON_FIELDS.items()}
    kwargs |= {"hidden_act": arch.act, arch.eps_field: config.norm_eps}
    for flag in ("attn_bias", "mlp_bias"):  # HF fields that exist for this class (others are fixed)
        if getattr(arch, flag)[0]:
            kwargs[getattr(arch, flag)[0]] = getattr(config, flag)
    if arch.fused_qkv:
        kwargs["use_parallel_residual"] = config.block == "parallel"
    else:
        kwargs |= {"num_key_value_heads": config.kv_heads} | ({"head_dim": D} if arch.head_dim_field else {})
    kwargs |= _hf_layout_fields(config, arch)
    theta, scaling = _hf_scaling(rope, rope.resolve_dims(D))
    kwargs |= _rope_kwargs(config_cls, arch, theta, _rotary_pct(rope.resolve_dims(D), D), scaling)
    if scaling["rope_type"] == "dynamic":  # HF's dynamic NTK grows beyond max_position_embeddings
        kwargs["max_position_embeddings"] = rope.scaling.original_max_position
    defaults = config_cls()  # token ids of the class's own vocabulary (SmolLM3's: 128,000 and up) do not carry over
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = getattr(defaults, name, None)
        if isinstance(token, int) and token >= config.vocab_size:
            kwargs[name] = None
    return config_cls(**kwargs)


__all__ = ["hf_architecture", "hf_config_for"]
