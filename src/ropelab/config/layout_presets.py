"""Released hybrid positional layouts as model presets (`MODEL_PRESETS`): which layers rotate, at
which theta and share of channels, and which see only a window, as Llama 4, SmolLM3, Command A,
Gemma 3 and Gemma 4 lay them out.

Each release gives two presets:

  published shape   smollm3-3b, llama4-scout-irope, command-a, gemma3-1b, gemma4
  CPU-sized         tiny-smollm3, tiny-llama4-irope, tiny-command-a, tiny-gemma3, tiny-gemma4

A tiny preset is tiny-llama (d_model 128, 2 query / 1 key-value heads of 64, d_ff 384, tied) with
the release's layout and nothing else of it: its kinds of layer and their pattern, thetas, rotated
shares and query temperature, its windows cut to 128 tokens so that they bite at CPU sequence
lengths. Block, norms and pair layout stay tiny-llama's, so a tiny study compares layouts alone.

A published-shape preset is ropelab's model of that shape and layout, not a conversion target: where
the release's block is something ropelab does not have, its comment says what is left out. The
layouts and shapes are checked layer by layer against transformers' config classes in
tests/config/test_layout_presets.py.

Plain mappings, as `model:` in a YAML file gives them; `ropelab.config.model` makes them ModelConfigs.
"""

from __future__ import annotations

TINY_WINDOW = 128  # tokens: sliding windows, attention chunks and Llama 4's floor_scale at CPU scale
TINY_SHAPE = dict(n_layer=4, d_model=128, n_head=2, n_kv_head=1, d_ff=384, tie_embeddings=True, max_seq_len=8192)


def _smollm3_layout() -> dict:
    """Every fourth layer NoPE, the others RoPE; all attend to every earlier token."""
    return {"layer_pattern": "RRRN", "layer_kinds": {"R": {}, "N": {"rope": "none"}}}


def _llama4_layout(chunk: int) -> dict:
    """Three RoPE layers that attend within chunks of `chunk` tokens, then one NoPE layer over the whole
    context whose queries sharpen with position (HF `attn_temperature_tuning`; floor_scale is the chunk)."""
    temperature = {"floor_scale": float(chunk), "attn_scale": 0.1}
    return {"layer_pattern": "LLLG", "layer_kinds": {
        "L": {"attention": "chunked", "window": chunk},
        "G": {"rope": "none", "temperature": temperature},
    }}


def _command_a_layout(window: int) -> dict:
    """Three sliding-window RoPE layers, then one NoPE layer over the whole context."""
    return {"layer_pattern": "LLLG", "layer_kinds": {
        "L": {"attention": "sliding", "window": window},
        "G": {"rope": "none"},
    }}


def _gemma_layout(n_layer: int, window: int, global_rope: dict) -> dict:
    """Five sliding-window layers at `model.rope` (theta 10k), then one global layer with `global_rope`;
    a pattern as long as the model where six does not divide n_layer (Gemma 3 1B's 26 layers)."""
    pattern = "LLLLLG" if n_layer % 6 == 0 else ("LLLLLG" * n_layer)[:n_layer]
    return {"layer_pattern": pattern, "layer_kinds": {
        "L": {"attention": "sliding", "window": window},
        "G": {"rope": dict(global_rope)},
    }}


GEMMA3_GLOBAL_ROPE = {"theta": 1_000_000.0}
# p-RoPE: a quarter of the head rotates, at the fastest frequencies of the whole head's spectrum
# (HF rope_type "proportional" = ropelab style truncate; HF puts the rotated pairs at channels
# [0, r/2) and [D/2, D/2 + r/2), ropelab at [0, r): the same model up to a permutation of channels).
GEMMA4_GLOBAL_ROPE = {"theta": 1_000_000.0, "fraction": 0.25, "style": "truncate"}

LAYOUT_PRESETS: dict[str, dict] = {
    # HuggingFaceTB/SmolLM3-3B config.json (transformers SmolLM3Config, its rope_theta 5e6 and
    # max_position_embeddings 65,536): Llama blocks, every fourth layer NoPE. Exactly SmolLM3.
    "smollm3-3b": dict(
        name="smollm3-3b", vocab_size=128_256, n_layer=36, d_model=2048, n_head=16, n_kv_head=4, d_ff=11_008,
        norm_eps=1e-6, tie_embeddings=True, max_seq_len=65_536, rope={"theta": 5_000_000.0}, **_smollm3_layout(),
    ),
    "tiny-smollm3": dict(name="tiny-smollm3", **TINY_SHAPE, rope={"theta": 5_000_000.0}, **_smollm3_layout()),
    # meta-llama/Llama-4-Scout-17B-16E text layers, as transformers' Llama4TextConfig() defaults give
    # them (its max_position_embeddings 131,072; the release's llama3 rope scaling is left out). Left
    # out as well: the mixture of experts (16 experts of 8,192 and a shared one; here one dense SwiGLU
    # MLP of intermediate_size_mlp 16,384, the width a token runs through) and the L2 norm of queries
    # and keys on RoPE layers. Pairs are interleaved as in Llama 4's complex-number RoPE.
    "llama4-scout-irope": dict(
        name="llama4-scout-irope", vocab_size=202_048, n_layer=48, d_model=5120, n_head=40, n_kv_head=8,
        head_dim=128, d_ff=16_384, max_seq_len=131_072, rope={"theta": 500_000.0, "layout": "interleaved"},
        **_llama4_layout(8192),
    ),
    "tiny-llama4-irope": dict(
        name="tiny-llama4-irope", **TINY_SHAPE, rope={"theta": 500_000.0}, **_llama4_layout(TINY_WINDOW),
    ),
    # CohereLabs/c4ai-command-a-03-2025 config.json (transformers Cohere2Config): parallel blocks of
    # LayerNorm, SwiGLU and GQA, interleaved RoPE pairs, tied embeddings. Left out: Cohere2's blocks
    # share one bias-free LayerNorm between attention and MLP (ropelab's parallel block has one per
    # branch, with biases) and its logit_scale multiplies the logits.
    "command-a": dict(
        name="command-a", vocab_size=256_000, n_layer=64, d_model=12_288, n_head=96, n_kv_head=8, d_ff=36_864,
        block="parallel", norm="layernorm", rope={"theta": 50_000.0, "layout": "interleaved"},
        tie_embeddings=True, **_command_a_layout(4096),
    ),
    "tiny-command-a": dict(
        name="tiny-command-a", **TINY_SHAPE, rope={"theta": 50_000.0}, **_command_a_layout(TINY_WINDOW),
    ),
    # google/gemma-3-1b-pt config.json (transformers Gemma3TextConfig): 26 layers, local theta 10k
    # with a 512-token window, global theta 1M. Left out: Gemma's GeGLU MLP (here SwiGLU of the same
    # width), its post-attention and pre/post-feedforward norms and its embeddings scaled by
    # sqrt(d_model); QK-norm is kept.
    "gemma3-1b": dict(
        name="gemma3-1b", vocab_size=262_144, n_layer=26, d_model=1152, n_head=4, n_kv_head=1, head_dim=256,
        d_ff=6912, norm_eps=1e-6, qk_norm=True, tie_embeddings=True, max_seq_len=32_768,
        rope={"theta": 10_000.0}, **_gemma_layout(26, 512, GEMMA3_GLOBAL_ROPE),
    ),
    "tiny-gemma3": dict(
        name="tiny-gemma3", **(TINY_SHAPE | {"n_layer": 6}), rope={"theta": 10_000.0},
        **_gemma_layout(6, TINY_WINDOW, GEMMA3_GLOBAL_ROPE),
    ),
    # transformers' Gemma4TextConfig() defaults (its documented checkpoint is google/gemma-4-e2b-it;
    # the released sizes vary this shape): local theta 10k over 512 tokens, global p-RoPE at theta 1M.
    # Left out, besides Gemma 3's pieces: the global layers' own head_dim of 512 (ropelab has one
    # head_dim; here the globals rotate a quarter of 256 channels), the norm on values with attention
    # logits left unscaled (not divided by sqrt(head_dim)), and the per-layer input embeddings.
    "gemma4": dict(
        name="gemma4", vocab_size=262_144, n_layer=30, d_model=2304, n_head=8, n_kv_head=4, head_dim=256,
        d_ff=9216, norm_eps=1e-6, qk_norm=True, tie_embeddings=True, max_seq_len=131_072,
        rope={"theta": 10_000.0}, **_gemma_layout(30, 512, GEMMA4_GLOBAL_ROPE),
    ),
    "tiny-gemma4": dict(
        name="tiny-gemma4", **(TINY_SHAPE | {"n_layer": 6}), rope={"theta": 10_000.0},
        **_gemma_layout(6, TINY_WINDOW, GEMMA4_GLOBAL_ROPE),
    ),
}
