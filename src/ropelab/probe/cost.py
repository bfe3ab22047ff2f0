"""Memory a probe needs: the model's own forward over the window, plus what the capture keeps.

An estimate, by formula, for one sequence of T tokens in inference mode (no autograd graph: a
layer's activations are freed when the next layer starts), with b bytes per activation
element (4 fp32, 2 bf16), model width C, MLP width F, H query and K key/value heads of D
channels, L layers, vocabulary V, R repeats:

  weights             = params * b
  forward (one layer) = T * (4C + 3F + 4HD + 4KD) * b
      the residual stream and its normed copy (2C), the attention output and its projection
      (2C); at the MLP the gate activation, the up projection and their product (3F); q before
      and after RoPE, attention output and its head-merged copy (4HD); k before and after RoPE,
      v and SDPA's per-row statistics (4KD, generous). Attention itself must be a flash or
      memory-efficient kernel (O(T) memory; PyTorch's SDPA on CPU and on CUDA is).
  streaming capture   = R * (L * (2HD + 2KD + C) + 2C + V) * 4      (analysis rows only, fp32)
  keeping everything  = T * (L * (2HD + 2KD + C) + 2C) * b + T * V * 4   (what streaming avoids)

peak ~ weights + forward (one layer) + streaming capture.
"""

from __future__ import annotations

from ropelab.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def memory_estimate(config: ModelConfig, params: int, window: int, repeats: int, precision: str = "bf16") -> dict[str, int]:
    """Bytes per component of the formula above, and ``peak`` (weights + forward + capture)."""
    b = DTYPE_BYTES[precision]
    C, F, L, V = config.d_model, config.d_ff, config.n_layer, config.vocab_size
    HD, KD = config.n_head * config.head_size, config.kv_heads * config.head_size
    per_layer_rows = 2 * HD + 2 * KD + C
    out = {
        "weights": params * b,
        "forward_layer": window * (4 * C + 3 * F + 4 * HD + 4 * KD) * b,
        "capture_streaming": repeats * (L * per_layer_rows + 2 * C + V) * 4,
        "capture_everything": window * (L * per_layer_rows + 2 * C) * b + window * V * 4,
    }
    out["peak"] = out["weights"] + out["forward_layer"] + out["capture_streaming"]
    return out
