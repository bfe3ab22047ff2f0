"""Fused in-place partial RoPE for CPU tensors: one C loop over q and k, compiled on first use.

Why a C loop: eager PyTorch has no single op for the half-layout rotation
(x1 cos - x2 sin, x2 cos + x1 sin), so `ropelab.rope.kernels.rotate_` needs four elementwise passes,
and each pass walks every (batch, head, token) row. Full rotation then costs several copies of q and k,
and at small fractions the per-row cost of those passes, not the bytes, dominates. This kernel
reads and writes the rotary channels of each row once, for q and k in one parallel loop, with
the loop order following the tensors' strides (so `Attention`'s transposed projection views are
walked in memory order). Everything else in the row is neither read nor written.

Numbers: float32 is computed without fused multiply-adds (``-ffp-contract=off``), so it gives
the same bits as the reference `ropelab.rope.reference.rotate`; bfloat16 is computed in float32
and rounded once to nearest even, as `rotate` does.

Build: `SOURCE` is compiled on first use by `ropelab.native` (once per machine, cached, OpenMP
on torch's thread pool). Without a compiler, or with ``ROPELAB_CPU_KERNEL=0``, `available()` is
False and `ropelab.rope.kernels` uses its torch path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Sequence

import torch

from ropelab.native import ADDRESS, DTYPES, F32, I64, PRELUDE, load

SOURCE = PRELUDE + r"""
/* One tensor: its address, then its three outer dimensions ordered by decreasing stride: sizes,
   strides in elements of the tensor, and strides in elements of where the angles come from (0
   where that broadcasts): cos/sin themselves, or the position ids that pick rows of a table. */
typedef struct { int64_t data, n[3], x[3], c[3]; } rows_t;

/* One row's pairs: (x1[i], x2[i]) <- (x1 cos - x2 sin, x2 cos + x1 sin), i < half, where x1 and x2
   are `step` elements apart pairwise (half layout: two separate runs; interleaved: neighbours). */
static inline __attribute__((always_inline)) void rotate_pairs(
    char *restrict x1, char *restrict x2, const float *restrict c, const float *restrict s,
    const int64_t half, const int64_t step, const int bf16, const float sign) {
  /* simd: vectorise even where gcc would otherwise unroll a short row into scalar code */
#pragma omp simd
  for (int64_t i = 0; i < half; i++) {
    const float a = load(x1, step * i, bf16), b = load(x2, step * i, bf16), cs = c[i], sn = sign * s[i];
    store(x1, step * i, a * cs - b * sn, bf16);
    store(x2, step * i, b * cs + a * sn, bf16);
  }
}

/* Rows lo..hi-1 (flat index over the three outer dimensions) of one tensor. */
static inline __attribute__((always_inline)) void rotate_rows(
    char *base, const rows_t *g, int64_t lo, int64_t hi, const int64_t *positions, const float *cos,
    const float *sin, const int64_t half, const int interleaved, const int bf16, const float sign) {
  const int64_t size = bf16 ? 2 : 4;
  /* A row rotated whole is a plain stream, which the hardware prefetchers follow; a part of each
     row is not (at fraction 0.1 one cache line of four), so then ask for the row 32 ahead. */
  const int prefetch = 2 * half < g->x[2];
  int64_t i2 = lo % g->n[2], rest = lo / g->n[2], i1 = rest % g->n[1], i0 = rest / g->n[1];
  int64_t r = lo;
  while (r < hi) {
    int64_t stop = r + g->n[2] - i2;
    if (stop > hi) stop = hi;
    char *x = base + size * (i0 * g->x[0] + i1 * g->x[1] + i2 * g->x[2]);
    int64_t at = i0 * g->c[0] + i1 * g->c[1] + i2 * g->c[2];
    for (; r < stop; r++, x += size * g->x[2], at += g->c[2]) {
      if (prefetch) __builtin_prefetch(x + 32 * size * g->x[2], 1);
      const int64_t angle = positions ? positions[at] * half : at;
      if (interleaved) rotate_pairs(x, x + size, cos + angle, sin + angle, half, 2, bf16, sign);
      else rotate_pairs(x, x + size * half, cos + angle, sin + angle, half, 1, bf16, sign);
    }
    i2 = 0;
    if (++i1 == g->n[1]) { i1 = 0; i0++; }
  }
}

/* Constant `half`, layout and dtype let the compiler unroll and vectorise the common sizes. */
#define ROWS(H, I, B) rotate_rows(base, g, lo, hi, positions, cos, sin, H, I, B, sign)
#define KINDS(H) if (interleaved) { if (bf16) ROWS(H, 1, 1); else ROWS(H, 1, 0); } \
                 else { if (bf16) ROWS(H, 0, 1); else ROWS(H, 0, 0); }
#define CASE(H) case H: KINDS(H); return;

static void dispatch(char *base, const rows_t *g, int64_t lo, int64_t hi, const int64_t *positions,
                     const float *cos, const float *sin, int64_t half, int interleaved, int bf16, float sign) {
  switch (half) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(6) CASE(8) CASE(12) CASE(16) CASE(24) CASE(32) CASE(48) CASE(64)
    default: KINDS(half);
  }
}

/* Rotate the first 2*half channels of every row of `count` tensors in place, by +angle
   (sign 1) or -angle (sign -1). Without positions (NULL) cos/sin hold each row's angles at the
   row's angle offset; with positions, cos/sin are tables of `half` columns and a row takes table
   row positions[offset] (the caller has checked every position against the table's length).
   Each thread gets at least 32768 channels (`team`, as torch's own parallel loops): waking a thread
   costs more than a small job. */
void ropelab_rotate(int64_t count, const rows_t *rows, const int64_t *positions, const float *cos,
                    const float *sin, int64_t half, int64_t interleaved, int64_t bf16, float sign,
                    int64_t threads) {
  int64_t total = 0;
  for (int64_t t = 0; t < count; t++) total += rows[t].n[0] * rows[t].n[1] * rows[t].n[2];
  #pragma omp parallel num_threads(team(threads, total * 2 * half))
  {
#ifdef _OPENMP
    const int64_t parts = omp_get_num_threads(), id = omp_get_thread_num();
#else
    const int64_t parts = 1, id = 0;
#endif
    int64_t begin = total * id / parts, end = total * (id + 1) / parts;
    for (int64_t t = 0; t < count; t++) {
      const int64_t n = rows[t].n[0] * rows[t].n[1] * rows[t].n[2];
      const int64_t lo = begin > 0 ? begin : 0, hi = end < n ? end : n;
      if (lo < hi)
        dispatch((char *)(intptr_t)rows[t].data, rows + t, lo, hi, positions, cos, sin, half, (int)interleaved,
                 (int)bf16, sign);
      begin -= n;
      end -= n;
    }
  }
}
"""

@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel, or None (disabled, no compiler, or the build failed: a warning says why)."""
    return load(SOURCE, "rope_cpu", "CPU RoPE kernel", {"ropelab_rotate": [
        I64, ctypes.POINTER(I64), ADDRESS, ADDRESS, ADDRESS, I64, I64, I64, F32, I64]})


def available() -> bool:
    return library() is not None


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel can rotate x: a 4-D float32/bfloat16 CPU tensor with unit channel stride."""
    return x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 4 and x.stride(-1) == 1


def supports_positions(positions: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `positions` can pick the table rows of x's (B, H, T) rows: int64 on the CPU, (B or 1, T)."""
    return (positions.dtype == torch.int64 and positions.device.type == "cpu" and positions.dim() == 2
            and positions.shape[1] == x.shape[2] and positions.shape[0] in (1, x.shape[0]))


def _rows(x: torch.Tensor, sizes: Sequence[int], strides: Sequence[int]) -> Optional[list[int]]:
    """x's `rows_t`: its address, then the sizes and strides of its three outer dimensions in
    memory order, and the angle source's strides over them. `sizes`/`strides` describe the angle
    source over x's (B, H, T) (size 1: broadcast). None if the source does not broadcast to x's rows."""
    shape, stride = x.shape, x.stride()
    if any(size != 1 and size != n for size, n in zip(sizes, shape)):
        return None
    order = sorted(range(3), key=stride.__getitem__, reverse=True)  # memory order, outermost first
    return [x.data_ptr(), *[shape[d] for d in order], *[stride[d] for d in order],
            *[0 if sizes[d] == 1 else strides[d] for d in order]]


def rotate_(
    tensors: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, layout: str,
    inverse: bool = False, positions: Optional[torch.Tensor] = None,
) -> bool:
    """Rotate the first `rotary_dims` channels of each tensor (B, H, T, D) in place, in one parallel loop.

    The angles come from float32 cos/sin, either (a) without `positions`: (..., T, rotary_dims/2),
    broadcastable to each tensor's rows; or (b) with int64 `positions` (B or 1, T): tables
    (P, rotary_dims/2), row (b, h, t) taking table row positions[b, t]. In (b) every position must
    lie in [0, P): the caller checks that (the kernel reads the table unchecked). The tensors must
    not overlap themselves or each other. Returns False, having touched nothing, when the kernel
    is unavailable or does not support the arguments (the caller then uses the torch path)."""
    lib = library()
    if lib is None or not tensors or not all(supports(x) and x.dtype == tensors[0].dtype for x in tensors):
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape:
        return False
    if cos.shape[-1] != rotary_dims // 2 or any(rotary_dims > x.shape[-1] for x in tensors):
        return False
    if positions is None:
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        pad = 4 - cos.dim()
        if pad < 0:
            return False
        sizes, strides = (1,) * pad + tuple(cos.shape[:-1]), (0,) * pad + cos.stride()[:-1]
    else:
        if cos.dim() != 2 or not all(supports_positions(positions, x) for x in tensors):
            return False
        cos, sin = cos.contiguous(), sin.contiguous()  # rows of `half` floats, as the kernel indexes them
        sizes, strides = (positions.shape[0], 1, positions.shape[1]), (positions.stride(0), 0, positions.stride(1))
    geometry = []
    for x in tensors:
        rows = _rows(x, sizes, strides)
        if rows is None:
            return False
        geometry += rows
    lib.ropelab_rotate(
        len(tensors), (ctypes.c_int64 * len(geometry))(*geometry), None if positions is None else positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), rotary_dims // 2, int(layout != "half"), DTYPES[tensors[0].dtype],
        -1.0 if inverse else 1.0, torch.get_num_threads(),
    )
    return True
