"""The transformers architectures ropelab converts exactly, and the names each gives to configuration
fields and modules (read by `ropelab.sources.hf_config_read`, `hf_config_write` and `hf`).

  ropelab configuration                                     transformers class
  --------------------------------------------------------  ---------------------------------------------
  sequential, rmsnorm, swiglu, full RoPE, no qk_norm         LlamaForCausalLM
  the same with NoPE layers among its RoPE layers, or        SmolLM3ForCausalLM (no_rope_layers, layer_types;
    sliding-window layers; head_dim = d_model / n_head         head_dim = hidden_size / heads)
  sequential, rmsnorm, swiglu, full RoPE, qk_norm, with      Qwen3ForCausalLM (layer_types)
    sliding-window layers or not
  layernorm, gelu (exact), MLP biases, MHA, half-layout      GPTNeoXForCausalLM
    RoPE with `slice` frequencies (any fraction)               (use_parallel_residual = block == "parallel")
  import only: Qwen2ForCausalLM (q/k/v biases, o_proj bias   -> ropelab attn_bias=True with a zero o_proj bias
    absent; sliding-window layers or not)

"Full RoPE" means rotary_dims == head_dim, where `slice` and `truncate` give the same frequencies.
The rotation layout must be `half` (rotate_half); the cos/sin cache mode does not change the math.
A layout (`model.layer_kinds`) converts when the class has it: NoPE layers (SmolLM3), sliding
windows of one size (SmolLM3, Qwen2, Qwen3); chunked attention and query temperature never do.
`REFUSED` names what ropelab lacks for the hybrid releases it does not convert.

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
    head_dim_field: bool = True  # False: the class has no head_dim, it is hidden_size / num_attention_heads
    nope_layers: bool = False  # `no_rope_layers` (1 RoPE, 0 NoPE per layer) is honoured
    sliding: bool = False  # `layer_types` "sliding_attention" layers see `sliding_window` tokens


ARCHS: dict[str, Arch] = {  # keyed by HF config.model_type
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                  LLAMA_MODULES, mlp_bias=("mlp_bias", False)),
    "smollm3": Arch("SmolLM3ForCausalLM", "SmolLM3Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                    LLAMA_MODULES, mlp_bias=("mlp_bias", False), head_dim_field=False, nope_layers=True,
                    sliding=True),
    "qwen3": Arch("Qwen3ForCausalLM", "Qwen3Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                  LLAMA_MODULES, qk_norm=True, sliding=True),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", "rmsnorm", "swiglu", "silu", "rms_norm_eps",
                  LLAMA_MODULES, attn_bias=(None, True), absent_zero=("attn.o_proj.bias",), head_dim_field=False,
                  sliding=True),  # import only
    "gpt_neox": Arch("GPTNeoXForCausalLM", "GPTNeoXConfig", "layernorm", "gelu", "gelu", "layer_norm_eps",
                     NEOX_MODULES, attn_bias=("attention_bias", True), mlp_bias=(None, True),
                     fused_qkv=True, partial_rope=True, scalings=("linear", "ntk", "dynamic")),
}

_GEMMA = ("extra norms (post-attention, pre- and post-feedforward RMSNorms), a GeGLU MLP "
          "(gelu_pytorch_tanh) and embeddings scaled by sqrt(hidden_size)")
# HF model_type -> what ropelab lacks to compute it; the positional layout alone is a preset
# (`ropelab.config.layout_presets`). Text and multimodal model_types alike.
REFUSED: dict[str, str] = {
    "gemma2": f"Gemma 2's {_GEMMA}, and soft-capped attention and final logits",
    **dict.fromkeys(("gemma3", "gemma3_text"), f"Gemma 3's {_GEMMA} (its layout alone: preset gemma3-1b)"),
    **dict.fromkeys(("gemma4", "gemma4_text"), f"Gemma 4's {_GEMMA}, a larger head_dim on its global layers, "
                    "unscaled attention logits over normalised values and per-layer input embeddings (its layout "
                    "alone: preset gemma4)"),
    "cohere2": ("Cohere2's logit_scale multiplying the logits, and one bias-free LayerNorm shared by each block's "
                "attention and MLP (ropelab's parallel block normalises each branch with its own; its layout "
                "alone: preset command-a)"),
    **dict.fromkeys(("llama4", "llama4_text"), (
        "Llama 4's mixture-of-experts MLPs (a router, num_local_experts experts and a shared expert; ropelab's MLP "
        "is dense) and the L2 norm of queries and keys on its RoPE layers (its layout alone: preset "
        "llama4-scout-irope)")),
}

LAYER_TYPES = ("full_attention", "sliding_attention")  # HF `layer_types` ropelab reads and writes

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


__all__ = ["Arch", "ARCHS", "REFUSED", "LAYER_TYPES", "LLAMA_MODULES", "NEOX_MODULES", "COMMON_FIELDS",
           "SCALING_FIELDS", "HF_FIELD_NAMES", "hf_model_class"]
