"""Rotary position embedding: the one place where RoPE math lives.

Conventions (see `RopeConfig` for the user-facing description):
  * only the first ``rotary_dims`` channels of each query/key head rotate; the rest pass
    through untouched (bit-identical);
  * ``rotary_dims = 2 * floor(fraction * head_dim / 2)``, at least 2 for fraction > 0;
  * ``slice`` frequencies ``theta^(-2i/rotary_dims)``, ``truncate`` ``theta^(-2i/head_dim)``,
    for i in [0, rotary_dims/2);
  * ``half`` pairs channel i with i + rotary_dims/2, ``interleaved`` pairs 2i with 2i+1;
  * angles are formed in float64 (exact for positions far beyond 2^24) and cos/sin are
    stored in float32 whatever the model dtype.

The math:
  frequencies.py    frequencies of a layer's rotated pairs, cos/sin of position x frequency
  scaling.py        context extension (linear, ntk, dynamic, yarn, llama3, longrope)
  pairs.py          selected-pair plans (MHA2MLA's partial RoPE)
  bound.py          the smallest base that keeps token discrimination over a context length
  reference.py      the reference rotation, out of place (`apply_partial_rope`)
The rotation in place:
  kernels.py        `rotate_qk_`: the fastest kernel that applies (Triton, the C loop, eager torch)
  cpu_kernel.py     the C loop for CPU tensors, compiled on first use
  triton_kernel.py  the Triton kernel for CUDA tensors
  inplace.py        `PartialRotary`, the in-place rotation as one autograd node, and when it is safe
The module:
  embedding.py      `RotaryEmbedding`: one layer setting's frequencies, cos/sin table and rotation
"""

from ropelab.rope.embedding import RotaryEmbedding
from ropelab.rope.frequencies import inverse_frequencies, layer_frequencies, rope_angles, table_cache_bytes
from ropelab.rope.inplace import partial_rotary, rotate_in_place
from ropelab.rope.kernels import rotate_, rotate_qk_, triton_kernels
from ropelab.rope.reference import apply_partial_rope, rotate

__all__ = [
    "RotaryEmbedding", "apply_partial_rope", "inverse_frequencies", "layer_frequencies", "partial_rotary", "rope_angles",
    "rotate", "rotate_", "rotate_in_place", "rotate_qk_", "table_cache_bytes", "triton_kernels",
]
