"""Hugging Face weight conversion: ropelab `Transformer` <-> transformers causal LMs.

Only exact equivalences convert; anything else raises a ValueError naming every reason.

  ropelab configuration                                     transformers class
  --------------------------------------------------------  ---------------------------------------------
  sequential, rmsnorm, swiglu, full RoPE, no qk_norm         LlamaForCausalLM
  sequential, rmsnorm, swiglu, full RoPE, qk_norm            Qwen3ForCausalLM
  layernorm, gelu (exact), MLP biases, MHA, half-layout      GPTNeoXForCausalLM
    RoPE with `slice` frequencies (any fraction)               (use_parallel_residual = block == "parallel")
  import only: Qwen2ForCausalLM (q/k/v biases, o_proj bias   -> ropelab attn_bias=True with a zero o_proj bias
    absent)

"Full RoPE" means rotary_dims == head_dim, where `slice` and `truncate` give the same frequencies.
The rotation layout must be `half` (rotate_half); the cos/sin cache mode does not change the math.

RoPE scaling (`rope.scaling`) travels as HF's rope types (transformers 5 `rope_parameters`, 4.x
`rope_scaling`): linear, dynamic, yarn, llama3 and longrope both ways, on Llama and Qwen3; GPT-NeoX
exports linear and dynamic. Static NTK (`ntk`, no HF rope type) is a change of base, so it exports
as the default rope type at the base it amounts to. HF's dynamic NTK grows from
max_position_embeddings: it imports as the original context, and a dynamic model exports with
max_position_embeddings = its original_max_position.

Shapes: C d_model, H query heads, K key/value heads, D head_dim, F d_ff, V vocab.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ropelab.config import ModelConfig, RopeConfig, RopeScalingConfig
from ropelab.model import Transformer

# ------------------------------------------------------------------ name tables

# ropelab module path -> HF module path ("{i}" = layer index). Leaf names (weight, bias) carry over,
# and so do child names missing here (Llama's q_proj/k_proj/v_proj/o_proj, q_norm/k_norm,
# gate_proj/up_proj/down_proj are named as in ropelab).
_LLAMA_MODULES = {
    "embed": "model.embed_tokens",  # (V, C)
    "final_norm": "model.norm",  # (C,)
    "lm_head": "lm_head",  # (V, C)
    "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blocks.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm",
    "blocks.{i}.attn": "model.layers.{i}.self_attn",  # q (H*D, C), k/v (K*D, C), o (C, H*D), q/k_norm (D,)
    "blocks.{i}.mlp": "model.layers.{i}.mlp",  # gate/up (F, C), down (C, F)
}
_NEOX_MODULES = {
    "embed": "gpt_neox.embed_in",
    "final_norm": "gpt_neox.final_layer_norm",
    "lm_head": "lm_head",  # "embed_out" before transformers 5: resolved from the model, see _modules_of
    "blocks.{i}.attn_norm": "gpt_neox.layers.{i}.input_layernorm",
    "blocks.{i}.mlp_norm": "gpt_neox.layers.{i}.post_attention_layernorm",
    "blocks.{i}.attn.qkv": "gpt_neox.layers.{i}.attention.query_key_value",  # (3*H*D, C), see _fuse_qkv
    "blocks.{i}.attn.o_proj": "gpt_neox.layers.{i}.attention.dense",  # (C, H*D)
    "blocks.{i}.mlp.up_proj": "gpt_neox.layers.{i}.mlp.dense_h_to_4h",  # (F, C)
    "blocks.{i}.mlp.down_proj": "gpt_neox.layers.{i}.mlp.dense_4h_to_h",  # (C, F)
}

# ModelConfig field -> HF config field, the same for every supported class.
_COMMON_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "init_std": "initializer_range",
    "tie_embeddings": "tie_word_embeddings",
}


@dataclass(frozen=True)
class _Arch:
    """One transformers architecture and what it fixes about the ropelab configuration."""

    model_class: str
    config_class: str
    norm: str
    mlp: str
    act: str  # HF hidden_act that equals ropelab's activation (GPT-NeoX "gelu" is the exact erf GELU)
    eps_field: str
    modules: dict
    # (HF config field, default) for ropelab attn_bias / mlp_bias; field None: fixed to the default.
    attn_bias: tuple = ("attention_bias", False)
    mlp_bias: tuple = (None, False)
    qk_norm: bool = False
    fused_qkv: bool = False  # GPT-NeoX: one query_key_value matrix, no GQA, head_dim = C / H
    partial_rope: bool = False  # rotary_pct / partial_rotary_factor is honoured
    scalings: tuple = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")  # rope.scaling methods exported
    absent_zero: tuple = ()  # ropelab parameter suffixes the HF class lacks (they are zero there)


_ARCHS: dict[str, _Arch] = {  # keyed by HF config.model_type
    "llama": _Arch("LlamaForCausalLM", "LlamaConfig", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                   _LLAMA_MODULES, mlp_bias=("mlp_bias", False)),
    "qwen3": _Arch("Qwen3ForCausalLM", "Qwen3Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                   _LLAMA_MODULES, qk_norm=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "Qwen2Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                   _LLAMA_MODULES, attn_bias=(None, True), absent_zero=("attn.o_proj.bias",)),  # import only
    "gpt_neox": _Arch("GPTNeoXForCausalLM", "GPTNeoXConfig", "layernorm", "gelu", "gelu", "layer_norm_eps",
                      _NEOX_MODULES, attn_bias=("attention_bias", True), mlp_bias=(None, True),
                      fused_qkv=True, partial_rope=True, scalings=("linear", "ntk", "dynamic")),
}

# RopeScalingConfig fields that each HF rope type reads (dynamic's original context is HF's
# max_position_embeddings, see the module docstring), and their HF names.
_SCALING_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
    "llama3": ("factor", "original_max_position", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position", "attention_factor", "short_factor", "long_factor"),
}
_HF_NAME = {"original_max_position": "original_max_position_embeddings"}


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - optional dependency
        raise ImportError("Hugging Face conversion needs transformers: pip install 'ropelab[hf]'") from exc
    return transformers


# ------------------------------------------------------------------ ropelab -> HF config


def hf_architecture(config: ModelConfig) -> str:
    """The HF model_type exactly equivalent to `config`, or a ValueError listing every obstacle."""
    if config.norm == "layernorm" and config.mlp == "gelu":
        name = "gpt_neox"
    elif config.norm == "rmsnorm" and config.mlp == "swiglu":
        name = "qwen3" if config.qk_norm else "llama"
    else:
        raise ValueError(
            f"no Hugging Face class pairs norm={config.norm} with mlp={config.mlp} "
            "(Llama/Qwen3: rmsnorm + swiglu; GPT-NeoX: layernorm + gelu)"
        )
    arch, why = _ARCHS[name], []
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
    if arch.fused_qkv and config.head_size * config.n_head != config.d_model:
        why.append(f"head_dim={config.head_size}: GPT-NeoX needs head_dim = d_model / n_head")
    why += _rope_obstacles(config, arch)
    if why:
        raise ValueError(f"cannot export {config.name!r} as {arch.model_class}: " + "; ".join(why))
    return name


def _rope_obstacles(config: ModelConfig, arch: _Arch) -> list[str]:
    rope, D, why = config.rope_for_layer(0), config.head_size, []
    if any(config.rope_for_layer(i) != rope for i in range(1, config.n_layer)):
        why.append("rope_layers give layers different RoPE settings; HF classes share one RoPE")
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


def _hf_scaling(rope: RopeConfig, rotary_dims: int) -> tuple[float, dict]:
    """(HF rope_theta, HF rope type fields) of the layer's RoPE; static NTK becomes its base."""
    scaling = rope.scaling
    if scaling is None:
        return rope.theta, {"rope_type": "default"}
    if scaling.method == "ntk":  # theta * factor^(dim/(dim-2)), dim the rotated channels (slice or full RoPE)
        return rope.theta * scaling.factor ** (rotary_dims / (rotary_dims - 2)), {"rope_type": "default"}
    fields = {_HF_NAME.get(name, name): getattr(scaling, name) for name in _SCALING_FIELDS[scaling.method]}
    return rope.theta, {"rope_type": scaling.method} | {k: v for k, v in fields.items() if v is not None}


def _rotary_pct(rotary_dims: int, head_dim: int) -> float:
    """A fraction p with int(head_dim * p) == rotary_dims, as GPT-NeoX computes its rotary channels."""
    pct = rotary_dims / head_dim
    while int(head_dim * pct) < rotary_dims:  # rounding below an integer: step up one ulp
        pct = math.nextafter(pct, 2.0)
    return pct


def _rope_kwargs(config_cls: type, arch: _Arch, theta: float, pct: float, scaling: dict) -> dict:
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
    """The transformers config (LlamaConfig, Qwen3Config or GPTNeoXConfig) equivalent to `config`."""
    arch = _ARCHS[hf_architecture(config)]
    config_cls = getattr(_transformers(), arch.config_class)
    rope, D = config.rope_for_layer(0), config.head_size
    kwargs = {theirs: getattr(config, ours) for ours, theirs in _COMMON_FIELDS.items()}
    kwargs |= {"hidden_act": arch.act, arch.eps_field: config.norm_eps}
    for flag in ("attn_bias", "mlp_bias"):  # HF fields that exist for this class (others are fixed)
        if getattr(arch, flag)[0]:
            kwargs[getattr(arch, flag)[0]] = getattr(config, flag)
    if arch.fused_qkv:
        kwargs["use_parallel_residual"] = config.block == "parallel"
    else:
        kwargs |= {"num_key_value_heads": config.kv_heads, "head_dim": D}
    theta, scaling = _hf_scaling(rope, rope.resolve_dims(D))
    kwargs |= _rope_kwargs(config_cls, arch, theta, _rotary_pct(rope.resolve_dims(D), D), scaling)
    if scaling["rope_type"] == "dynamic":  # HF's dynamic NTK grows beyond max_position_embeddings
        kwargs["max_position_embeddings"] = rope.scaling.original_max_position
    return config_cls(**kwargs)


# ------------------------------------------------------------------ HF -> ropelab config


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
    if rope_type != "default" and rope_type not in _SCALING_FIELDS:
        raise ValueError(f"{hf_config.model_type}: rope_type={rope_type!r} has no ropelab equivalent "
                         f"(ropelab reads default, {', '.join(_SCALING_FIELDS)})")
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None)
    theta = theta or getattr(hf_config, "rotary_emb_base", None)  # transformers 4.x GPT-NeoX
    pct = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if pct is None:
        pct = getattr(hf_config, "rotary_pct", 1.0)
    extension = None if rope_type == "default" else _read_scaling(rope_type, scaling | params, hf_config)
    return float(theta if theta is not None else 10_000.0), float(pct), extension


def _read_scaling(rope_type: str, fields: dict, hf_config) -> RopeScalingConfig:
    """The RopeScalingConfig of an HF rope type, with the defaults HF's own functions fill in."""
    values = {name: fields[_HF_NAME.get(name, name)] for name in _SCALING_FIELDS[rope_type]
              if fields.get(_HF_NAME.get(name, name)) is not None}
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


def _arch_of(hf_config) -> _Arch:
    arch = _ARCHS.get(getattr(hf_config, "model_type", None))
    if arch is None:
        supported = ", ".join(a.model_class for a in _ARCHS.values())
        model_type = getattr(hf_config, "model_type", None)
        raise ValueError(f"model_type={model_type!r}: not convertible; supported: {supported}")
    return arch


def model_config_from_hf(hf_config) -> ModelConfig:
    """The ropelab ModelConfig of a Llama, Qwen2, Qwen3 or GPT-NeoX transformers config."""
    arch = _arch_of(hf_config)
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
        **{ours: get(theirs) for ours, theirs in _COMMON_FIELDS.items()},
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


# ------------------------------------------------------------------ state dicts

_QKV = re.compile(r"(blocks\.\d+\.attn\.)([qkv])_proj\.(weight|bias)")
_FUSED = re.compile(r"(blocks\.\d+\.attn\.)qkv\.(weight|bias)")


def _fuse_qkv(state: dict, n_head: int, head_dim: int) -> dict:
    """q/k/v_proj (H*D, C) each -> qkv (3*H*D, C), rows per head [q_h, k_h, v_h] as GPT-NeoX reads them
    (its forward views the output as (..., H, 3*D) and chunks the last axis in three)."""
    out = {}
    for key, value in state.items():
        m = _QKV.fullmatch(key)
        if not m:
            out[key] = value
        elif m[2] == "q":
            parts = [state[f"{m[1]}{p}_proj.{m[3]}"].reshape(n_head, head_dim, -1) for p in "qkv"]  # 3 x (H, D, C|1)
            out[f"{m[1]}qkv.{m[3]}"] = torch.stack(parts, 1).reshape(-1, *value.shape[1:])  # (H, 3, D, .) -> (3HD, .)
    return out


def _split_qkv(state: dict, n_head: int, head_dim: int) -> dict:
    """The inverse of `_fuse_qkv`."""
    out = {}
    for key, value in state.items():
        m = _FUSED.fullmatch(key)
        if not m:
            out[key] = value
            continue
        per_head = value.reshape(n_head, 3, head_dim, -1)  # (H, 3, D, C|1)
        for p, part in zip("qkv", per_head.unbind(1)):
            out[f"{m[1]}{p}_proj.{m[2]}"] = part.reshape(-1, *value.shape[1:])  # (H*D, .)
    return out


def _rename(key: str, modules: dict) -> str:
    """ropelab parameter name -> HF name through the longest matching module prefix."""
    layer = re.match(r"blocks\.(\d+)\.", key)
    template = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", key)
    for src in sorted(modules, key=len, reverse=True):
        if template.startswith(src + "."):
            return (modules[src] + template[len(src):]).replace("{i}", layer[1] if layer else "")
    raise KeyError(f"no Hugging Face name for ropelab parameter {key}")


def _modules_of(hf_model: nn.Module, arch: _Arch) -> dict:
    """The arch's name table with the output head's real name (GPT-NeoX: embed_out in transformers 4)."""
    head = hf_model.get_output_embeddings()
    name = next(n for n, m in hf_model.named_modules() if m is head)
    return arch.modules | {"lm_head": name}


# ------------------------------------------------------------------ conversion


def to_hf(model: Transformer, attn_implementation: str = "sdpa"):
    """A transformers model computing the same logits as `model` (same dtype and device), eval mode."""
    config = model.config
    hf_config = hf_config_for(config)
    arch = _ARCHS[hf_config.model_type]
    model_cls = getattr(_transformers(), arch.model_class)
    weight = model.embed.weight
    try:
        hf_model = model_cls._from_config(hf_config, dtype=weight.dtype, attn_implementation=attn_implementation)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        hf_model = model_cls._from_config(hf_config, torch_dtype=weight.dtype, attn_implementation=attn_implementation)
    state = model.state_dict()
    if arch.fused_qkv:
        state = _fuse_qkv(state, config.n_head, config.head_size)
    modules = _modules_of(hf_model, arch)
    hf_model.load_state_dict({_rename(k, modules): v for k, v in state.items()}, strict=True)
    return hf_model.to(weight.device).eval()


def hf_model_class(model_type: str) -> str:
    """The transformers class name of an HF `model_type` ropelab converts (see `hf_architecture`)."""
    return _ARCHS[model_type].model_class


def from_hf(hf_model) -> Transformer:
    """A ropelab Transformer computing the same logits as a Llama/Qwen2/Qwen3/GPT-NeoX causal LM."""
    arch = _arch_of(hf_model.config)
    if type(hf_model).__name__ != arch.model_class:
        raise ValueError(f"{type(hf_model).__name__}: expected {arch.model_class} (a causal LM with its head)")
    config = model_config_from_hf(hf_model.config)
    model = Transformer(config)
    target = model.state_dict()
    keys = dict.fromkeys(_QKV.sub(r"\1qkv.\3", k) for k in target) if arch.fused_qkv else target
    hf_state, modules, state = hf_model.state_dict(), _modules_of(hf_model, arch), {}
    for key in keys:
        hf_key = _rename(key, modules)
        if hf_key in hf_state:
            state[key] = hf_state[hf_key]
        elif key.endswith(arch.absent_zero):
            state[key] = torch.zeros_like(target[key])
        else:
            raise ValueError(f"{arch.model_class}: weight {hf_key} (for ropelab {key}) not found")
    if arch.fused_qkv:
        state = _split_qkv(state, config.n_head, config.head_size)
    model.load_state_dict(state, strict=True)
    weight = hf_model.get_input_embeddings().weight
    return model.to(device=weight.device, dtype=weight.dtype).eval()


__all__ = ["to_hf", "from_hf", "hf_config_for", "hf_architecture", "hf_model_class", "model_config_from_hf"]
