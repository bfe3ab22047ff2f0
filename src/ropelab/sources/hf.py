"""Hugging Face weight conversion: ropelab `Transformer` <-> transformers causal LMs.

  to_hf(model)      a transformers model computing the same logits (its config:
                    `ropelab.sources.hf_config_write.hf_config_for`)
  from_hf(hf_model) the ropelab Transformer computing the same logits (its config:
                    `ropelab.sources.hf_config_read.model_config_from_hf`)

Only exact equivalences convert (the classes: `ropelab.sources.hf_archs`); anything else raises a
ValueError naming every reason. Weights are renamed through each architecture's module table; for
GPT-NeoX, ropelab's q/k/v projections are fused into its one query_key_value matrix and split back.

Shapes: C d_model, H query heads, D head_dim.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ropelab.config import ConfigError
from ropelab.model import Transformer
from ropelab.sources.hf_archs import ARCHS, Arch
from ropelab.sources.hf_config_read import arch_of, model_config_from_hf
from ropelab.sources.hf_config_write import hf_config_for
from ropelab.sources.transformers_lib import require_transformers

_QKV = re.compile(r"(blocks\.\d+\.attn\.)([qkv])_proj\.(weight|bias)")
_FUSED = re.compile(r"(blocks\.\d+\.attn\.)qkv\.(weight|bias)")
# buffers some transformers versions save that are no weights: RoPE frequencies, GPT-NeoX 4.x's causal masks
_NOT_WEIGHTS = ("inv_freq", "attention.bias", "attention.masked_bias")


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


def _modules_of(hf_model: nn.Module, arch: Arch) -> dict:
    """The arch's name table with the output head's real name (GPT-NeoX: embed_out in transformers 4)."""
    head = hf_model.get_output_embeddings()
    name = next(n for n, m in hf_model.named_modules() if m is head)
    return arch.modules | {"lm_head": name}


def to_hf(model: Transformer, attn_implementation: str = "sdpa"):
    """A transformers model computing the same logits as `model` (same dtype and device), eval mode."""
    config = model.config
    hf_config = hf_config_for(config)
    arch = ARCHS[hf_config.model_type]
    model_cls = getattr(require_transformers("Hugging Face conversion"), arch.model_class)
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


def from_hf(hf_model) -> Transformer:
    """A ropelab Transformer computing the same logits as a Llama/SmolLM3/Qwen2/Qwen3/GPT-NeoX causal LM."""
    arch = arch_of(hf_model.config)
    if type(hf_model).__name__ != arch.model_class:
        raise ValueError(f"{type(hf_model).__name__}: expected {arch.model_class} (a causal LM with its head)")
    config = model_config_from_hf(hf_model.config)
    model = Transformer(config, init=False)
    target = model.state_dict()
    keys = dict.fromkeys(_QKV.sub(r"\1qkv.\3", k) for k in target) if arch.fused_qkv else target
    hf_state, modules, state = hf_model.state_dict(), _modules_of(hf_model, arch), {}
    hf_names = {key: _rename(key, modules) for key in keys}
    for key, hf_key in hf_names.items():
        if hf_key in hf_state:
            state[key] = hf_state[hf_key]
        elif key.endswith(arch.absent_zero):
            state[key] = torch.zeros_like(target[key])
        else:
            raise ValueError(f"{arch.model_class}: weight {hf_key} (for ropelab {key}) not found")
    unused = sorted(set(hf_state) - set(hf_names.values()) - {
        k for k in hf_state if k.endswith(_NOT_WEIGHTS)})
    if unused:  # a weight ropelab would drop computes something ropelab's model does not (a position encoding)
        raise ConfigError(f"{arch.model_class}: weight {unused[0]} has no place in ropelab's model"
                          f"{f' (and {len(unused) - 1} more)' if len(unused) > 1 else ''}; not convertible exactly")
    if arch.fused_qkv:
        state = _split_qkv(state, config.n_head, config.head_size)
    model.load_state_dict(state, strict=True)
    weight = hf_model.get_input_embeddings().weight
    return model.to(device=weight.device, dtype=weight.dtype).eval()


__all__ = ["to_hf", "from_hf"]
