"""Fused in-place partial RoPE for CUDA tensors: one Triton kernel for q and k.

`ropelab.rope.kernels` imports this module only when CUDA is available and Triton imports; it
then rotates q and k with `rotate_qk_` inside `PartialRotary` (forward: +angle, backward: -angle on
the incoming gradients). Each program owns a block of tokens of one sequence and a group of heads:
it forms cos/sin for its tokens once, then for each head loads the rotary channels, rotates them
in float32 and stores them back in the tensor's dtype. The pass-through channels are never
loaded or stored, so the bytes moved follow the fraction.

Where the angles come from (one of):
  * ``cos``/``sin``: float32 (B|1, 1, T, rotary_dims/2), as `RotaryEmbedding.cos_sin` returns;
  * ``positions`` (B|1, T) with ``cos_table``/``sin_table`` (max position + 1, rotary_dims/2):
    the ``table`` cache, looked up inside the kernel;
  * ``positions`` with ``inv_freq`` (rotary_dims/2, float64): the ``none`` cache. The angle
    position * frequency is formed and reduced modulo 2 pi in float64 (exact far beyond 2^24
    tokens, like `ropelab.rope.frequencies.rope_angles`), and only the reduced angle goes to float32
    for cos/sin.

The kernel also runs under ``TRITON_INTERPRET=1`` on CPU tensors, which is how the tests check it
without a GPU.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_T = 32
HEADS_PER_PROGRAM = 4
FROM_COS_SIN, FROM_TABLE, FROM_FREQUENCIES = 0, 1, 2
TWO_PI = tl.constexpr(2 * math.pi)
# Kernels are decorated for the interpreter when TRITON_INTERPRET=1 at import; they then take CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rotate_head(x_ptr, rows, first, second, cos, sin, mask):
    """Rotate the pairs (first, second) of the rows at x_ptr + rows in place."""
    x1 = tl.load(x_ptr + rows + first, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + rows + second, mask=mask).to(tl.float32)
    tl.store(x_ptr + rows + first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + rows + second, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, freq_ptr,
    T, HQ, HK,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sp_b, sp_t, sc_b, sc_t,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr, ANGLES: tl.constexpr, INVERSE: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)  # int64 offsets: q of a long context exceeds 2^31 elements
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, BLOCK_HALF)
    t_mask = t < T
    mask = t_mask[:, None] & (i < HALF)[None, :]
    if ANGLES == 0:  # cos/sin given per (sequence, token)
        at = b * sc_b + t[:, None] * sc_t + i[None, :]
        cos = tl.load(cos_ptr + at, mask=mask, other=1.0)
        sin = tl.load(sin_ptr + at, mask=mask, other=0.0)
    else:
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=t_mask, other=0)
        if ANGLES == 1:  # table row = position
            at = pos[:, None] * HALF + i[None, :]
            cos = tl.load(cos_ptr + at, mask=mask, other=1.0)
            sin = tl.load(sin_ptr + at, mask=mask, other=0.0)
        else:  # from the frequencies, reduced modulo 2 pi in float64
            freq = tl.load(freq_ptr + i, mask=i < HALF, other=0.0)
            angle = pos[:, None].to(tl.float64) * freq[None, :]
            angle = (angle - tl.floor(angle / TWO_PI) * TWO_PI).to(tl.float32)
            cos = tl.cos(angle)
            sin = tl.sin(angle)
    if INVERSE:
        sin = -sin
    if INTERLEAVED:
        first = 2 * i[None, :]
        second = first + 1
    else:
        first = i[None, :]
        second = first + HALF
    h0 = tl.program_id(2).to(tl.int64) * HEADS  # int64 bounds: the loop index is int64 too
    h1 = tl.minimum(h0 + HEADS, HQ + HK)
    for h in range(h0, tl.minimum(h1, HQ)):
        _rotate_head(q_ptr, b * sq_b + h * sq_h + t[:, None] * sq_t, first, second, cos, sin, mask)
    for h in range(tl.maximum(h0, HQ) - HQ, h1 - HQ):
        _rotate_head(k_ptr, b * sk_b + h * sk_h + t[:, None] * sk_t, first, second, cos, sin, mask)


def supports(q: torch.Tensor, k: torch.Tensor, positions: Optional[torch.Tensor] = None) -> bool:
    """Whether `rotate_qk_` can rotate q (B, Hq, T, D) and k (B, Hk, T, D) [at positions (B|1, T)]."""
    ok = all(
        x.dim() == 4 and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.device == q.device and x.shape[0] == q.shape[0] and x.shape[2] == q.shape[2]
        for x in (q, k)
    )
    if positions is not None:
        ok = ok and positions.dim() == 2 and positions.shape[0] in (1, q.shape[0]) and positions.shape[1] == q.shape[2]
    return ok and (q.is_cuda or INTERPRETED)


def rotate_qk_(
    q: torch.Tensor, k: torch.Tensor, *, rotary_dims: int, layout: str = "half", inverse: bool = False,
    cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None, cos_table: Optional[torch.Tensor] = None,
    sin_table: Optional[torch.Tensor] = None, inv_freq: Optional[torch.Tensor] = None,
) -> None:
    """Rotate the first `rotary_dims` channels of q and k in place (by -angle when `inverse`).

    Angles from `cos`/`sin`, or from `positions` with `cos_table`/`sin_table` or with `inv_freq`
    (see the module docstring). q and k must not overlap; check `supports` first."""
    B, HQ, T, _ = q.shape
    HK = k.shape[1]
    half = rotary_dims // 2
    dummy = q  # pointer arguments the chosen mode does not read
    sc_b = sc_t = sp_b = sp_t = 0
    if cos is not None:
        mode = FROM_COS_SIN
        cos, sin = (x.expand(B, 1, T, half).float() for x in (cos, sin))
        if cos.stride(-1) != 1 or cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        sc_b, sc_t = cos.stride(0), cos.stride(2)
        pos, freq = dummy, dummy
    else:
        pos = positions.expand(B, T)
        sp_b, sp_t = pos.stride()
        if cos_table is not None:
            mode, freq = FROM_TABLE, dummy
            cos, sin = cos_table.contiguous(), sin_table.contiguous()
        else:
            mode, cos, sin = FROM_FREQUENCIES, dummy, dummy
            freq = inv_freq.to(device=q.device, dtype=torch.float64)
    grid = (triton.cdiv(T, BLOCK_T), B, triton.cdiv(HQ + HK, HEADS_PER_PROGRAM))
    _rope_kernel[grid](
        q, k, pos, cos, sin, freq, T, HQ, HK,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), sp_b, sp_t, sc_b, sc_t,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK=BLOCK_T, HEADS=HEADS_PER_PROGRAM,
        INTERLEAVED=layout != "half", ANGLES=mode, INVERSE=inverse,
    )


def moved_bytes(q: torch.Tensor, k: torch.Tensor, rotary_dims: int) -> int:
    """Bytes one call reads and writes in q and k: the rotary channels, once each way."""
    rows = math.prod(q.shape[:-1]) + math.prod(k.shape[:-1])
    return 2 * rows * rotary_dims * q.element_size()
