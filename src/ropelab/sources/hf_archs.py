"""The transformers architectures ropelab converts exactly, and the names each gives to configuration
fields and modules (read by `ropelab.sources.hf_config_read`, `hf_config_write` and `hf`).

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

Shapes: C d_model, H query heads, K key/value heads, D head_dim, F d_ff, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

# ropelab module path -> HF module path ("{i}" = layer index). Leaf names (weight, bias) carry over,
# and so do child names missing here (Llama's q_proj/k_proj/v_proj/o_proj, q_norm/k_norm,
# gate_proj/up_proj/down_proj are named as in ropelab).
LLAMA_MODULES = {
    "embed": "model.embed_tokens",  # (V, C)
    "final_norm": "model.norm",  # (C,)
    "lm_head": "lm_head",  # (V, C)
    "blocks.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blocks.{i}.mlp_norm": "model.layers.{i}.post_attention_layernorm",
    "blocks.{i}.attn": "model.layers.{i}.self_attn",  # q (H*D, C), k/v (K*D, C), o (C, H*D), q/k_norm (D,)
    "blocks.{i}.mlp": "model.layers.{i}.mlp",  # gate/up (F, C), down (C, F)
}
NEOX_MODULES = {
    "embed": "gpt_neox.embed_in",
    "final_norm": "gpt_neox.final_layer_norm",
    "lm_head": "lm_head",  # "embed_out" before transformers 5: resolved from the model (`ropelab.sources.hf`)
    "blocks.{i}.attn_norm": "gpt_neox.layers.{i}.input_layernorm",
    "blocks.{i}.mlp_norm": "gpt_neox.layers.{i}.post_attention_layernorm",
    "blocks.{i}.attn.qkv": "gpt_neox.layers.{i}.attention.query_key_value",  # (3*H*D, C), fused per head
    "blocks.{i}.attn.o_proj": "gpt_neox.layers.{i}.attention.dense",  # (C, H*D)
    "blocks.{i}.mlp.up_proj": "gpt_neox.layers.{i}.mlp.dense_h_to_4h",  # (F, C)
    "blocks.{i}.mlp.down_proj": "gpt_neox.layers.{i}.mlp.dense_4h_to_h",  # (C, F)
}

# ModelConfig field -> HF config field, the same for every supported class.
COMMON_FIELDS = {
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
class Arch:
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


ARCHS: dict[str, Arch] = {  # keyed by HF config.model_type
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                  LLAMA_MODULES, mlp_bias=("mlp_bias", False)),
    "qwen3": Arch("Qwen3ForCausalLM", "Qwen3Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                  LLAMA_MODULES, qk_norm=True),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                  LLAMA_MODULES, attn_bias=(None, True), absent_zero=("attn.o_proj.bias",)),  # import only
    "gpt_neox": Arch("GPTNeoXForCausalLM", "GPTNeoXConfig", "layernorm", "gelu", "gelu", "layer_norm_eps",
                     NEOX_MODULES, attn_bias=("attention_bias", True), mlp_bias=(None, True),
                     fused_qkv=True, partial_rope=True, scalings=("linear", "ntk", "dynamic")),
}

# RopeScalingConfig fields that each HF rope type reads (dynamic's original context is HF's
# max_position_embeddings, see `ropelab.sources.hf_config_read`), and their HF names.
SCALING_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
    "llama3": ("factor", "original_max_position", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position", "attention_factor", "short_factor", "long_factor"),
}
HF_FIELD_NAMES = {"original_max_position": "original_max_position_embeddings"}  # where HF's name differs


def hf_model_class(model_type: str) -> str:
    """The transformers class name of an HF `model_type` ropelab converts (`ARCHS`)."""
    return ARCHS[model_type].model_class


__all__ = ["Arch", "ARCHS", "LLAMA_MODULES", "NEOX_MODULES", "COMMON_FIELDS", "SCALING_FIELDS", "HF_FIELD_NAMES",
           "hf_model_class"]
