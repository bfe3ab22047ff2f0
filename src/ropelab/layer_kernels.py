"""One-pass C loops for `ropelab.layers` on CPU: RMSNorm forward and backward, SwiGLU forward and backward,
and the sum of a float32 tensor and a bf16 one (the residual add of a bf16 branch; `ropelab.train.loss`
sums its bf16 head gradients with it too).

Why: written in eager PyTorch, RMSNorm's backward is nine elementwise passes over (tokens, C) and
SwiGLU's five over (tokens, F), each reading and writing whole tensors, and under bf16 autocast
every cast is one more. On a 2-core CPU these passes cost 15-20% of a SmolLM2-135M training step
beside its matrix products (BENCHMARKS.md, "GEMM floor"). Each loop here reads its inputs once and
writes its outputs once.

Numbers: the loops round where the plain expressions of `ropelab.layers` round (each torch op's
result in its dtype: the normalised x in x's dtype, silu(g) before the product with up, every
bf16 product), and compute in float32 in between, as torch's CPU kernels do. They differ from
torch in two places only: exp (a degree-7 polynomial after range reduction, within 2 float32 ulp
of the true value, where torch uses Sleef's), and the sums: RMSNorm's mean of x^2 and its backward's
row dot product add float terms in double (torch adds them pairwise in float), and the weight
gradient sums over tokens in float per thread, in another order than torch's. So their results are
within one rounding of the plain expressions' (tests/test_layer_kernels.py), and a given input
gives the same bits at a given thread count, run to run.

`ropelab.layers` calls these wherever they apply (contiguous float32/bfloat16 CPU tensors, not
under torch.compile) and runs its torch expressions otherwise; ``ROPELAB_CPU_KERNEL=0`` switches
them off (`ropelab.native`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Sequence

import torch

from ropelab.native import ADDRESS, DTYPES, F32, I64, PRELUDE, load, runs_on

SOURCE = PRELUDE + r"""
/* ---- SwiGLU: hidden = silu(g) * u; torch: silu(g) = g / (1 + exp(-g)) rounded to g's dtype, then
   the product rounded; backward: grad_up = d * silu(g), grad_gate = silu_backward(d * u, g) =
   (d * u) * s * (1 + g * (1 - s)) with s = 1 / (1 + exp(-g)). */

static inline __attribute__((always_inline)) void swiglu_span(
    const void *gate, const void *up, void *hidden, const int64_t lo, const int64_t hi, const int bf16) {
#pragma omp simd
  for (int64_t i = lo; i < hi; i++) {
    const float g = load(gate, i, bf16), silu = rounded(g / (1.0f + exp_of(-g)), bf16);
    store(hidden, i, silu * load(up, i, bf16), bf16);
  }
}

void ropelab_swiglu(int64_t n, const void *gate, const void *up, void *hidden, int64_t bf16, int64_t threads) {
#pragma omp parallel num_threads(team(threads, n))
  {
    SPAN(n, lo, hi);
    if (bf16) swiglu_span(gate, up, hidden, lo, hi, 1);
    else swiglu_span(gate, up, hidden, lo, hi, 0);
  }
}

static inline __attribute__((always_inline)) void swiglu_backward_span(
    const void *gate, const void *up, const void *grad, void *hidden, void *grad_gate, void *grad_up,
    const int64_t lo, const int64_t hi, const int bf16, const int with_hidden) {
#pragma omp simd
  for (int64_t i = lo; i < hi; i++) {
    const float g = load(gate, i, bf16), u = load(up, i, bf16), d = load(grad, i, bf16);
    const float e = exp_of(-g), s = 1.0f / (1.0f + e), silu = rounded(g / (1.0f + e), bf16);
    if (with_hidden) store(hidden, i, silu * u, bf16);
    store(grad_up, i, d * silu, bf16);
    store(grad_gate, i, rounded(d * u, bf16) * s * (1.0f + g * (1.0f - s)), bf16);
  }
}

/* hidden may be NULL (not written) */
void ropelab_swiglu_backward(int64_t n, const void *gate, const void *up, const void *grad, void *hidden,
                             void *grad_gate, void *grad_up, int64_t bf16, int64_t threads) {
#pragma omp parallel num_threads(team(threads, 2 * n))
  {
    SPAN(n, lo, hi);
    if (bf16 && hidden) swiglu_backward_span(gate, up, grad, hidden, grad_gate, grad_up, lo, hi, 1, 1);
    else if (bf16) swiglu_backward_span(gate, up, grad, hidden, grad_gate, grad_up, lo, hi, 1, 0);
    else if (hidden) swiglu_backward_span(gate, up, grad, hidden, grad_gate, grad_up, lo, hi, 0, 1);
    else swiglu_backward_span(gate, up, grad, hidden, grad_gate, grad_up, lo, hi, 0, 0);
  }
}

/* ---- out = x + part, x and out float32 (out may be x: in place), part of dtype P widened exactly. torch's
   x + part (or x.add_(part)) of a bf16 part first copies it to a new float32 tensor, then adds: two
   passes, one rounding, as here. The residual add of a bf16 branch, and the loss's sum of bf16 head
   gradients into a float32 one. */

void ropelab_add_widened(int64_t n, const float *x, const void *part, float *out, int64_t P, int64_t threads) {
#pragma omp parallel num_threads(team(threads, n))
  {
    SPAN(n, lo, hi);
    if (P) {
#pragma omp simd
      for (int64_t i = lo; i < hi; i++) out[i] = x[i] + load(part, i, 1);
    } else {
#pragma omp simd
      for (int64_t i = lo; i < hi; i++) out[i] = x[i] + load(part, i, 0);
    }
  }
}

/* ---- RMSNorm over rows of C: out = w * (x * rstd) with rstd = 1 / sqrt(mean(x^2) + eps) in float32;
   torch rounds x * rstd to x's dtype (X), the product with w to the promoted dtype of w and x (P),
   and autocast then casts that to its dtype (O). A flag per dtype: 1 for bf16, 0 for float32. */

static inline __attribute__((always_inline)) void rms_norm_rows(
    const int64_t lo, const int64_t hi, const int64_t C, const void *x, const void *w, void *out, float *rstd,
    const int reuse, const float eps, const int X, const int W, const int P, const int O) {
  for (int64_t r = lo; r < hi; r++) {
    const int64_t at = r * C;
    float rs;
    if (reuse) {
      rs = rstd[r];
    } else {
      double squares = 0.0;  /* each square rounded to float, as torch's pow(2); summed in double */
#pragma omp simd reduction(+ : squares)
      for (int64_t c = 0; c < C; c++) {
        const float v = load(x, at + c, X);
        squares += (double)(v * v);
      }
      rs = 1.0f / sqrtf((float)squares / (float)C + eps);
      rstd[r] = rs;
    }
#pragma omp simd
    for (int64_t c = 0; c < C; c++)
      store(out, at + c, rounded(load(w, c, W) * rounded(load(x, at + c, X) * rs, X), P), O);
  }
}

#define DTYPE_CASES(CALL, LAST) \
  switch (X * 8 + W * 4 + P * 2 + LAST) { \
    case 0: CALL(0, 0, 0, 0); break; case 1: CALL(0, 0, 0, 1); break; case 2: CALL(0, 0, 1, 0); break; \
    case 3: CALL(0, 0, 1, 1); break; case 4: CALL(0, 1, 0, 0); break; case 5: CALL(0, 1, 0, 1); break; \
    case 6: CALL(0, 1, 1, 0); break; case 7: CALL(0, 1, 1, 1); break; case 8: CALL(1, 0, 0, 0); break; \
    case 9: CALL(1, 0, 0, 1); break; case 10: CALL(1, 0, 1, 0); break; case 11: CALL(1, 0, 1, 1); break; \
    case 12: CALL(1, 1, 0, 0); break; case 13: CALL(1, 1, 0, 1); break; case 14: CALL(1, 1, 1, 0); break; \
    default: CALL(1, 1, 1, 1); \
  }

/* rstd (rows floats): written, or (reuse) read, as backward recomputes the normalised x */
void ropelab_rms_norm(int64_t rows, int64_t C, const void *x, const void *w, void *out, float *rstd, int64_t reuse,
                      float eps, int64_t X, int64_t W, int64_t P, int64_t O, int64_t threads) {
#pragma omp parallel num_threads(team(threads, rows * C))
  {
    SPAN(rows, lo, hi);
#define NORM(X_, W_, P_, O_) rms_norm_rows(lo, hi, C, x, w, out, rstd, (int)reuse, eps, X_, W_, P_, O_)
    DTYPE_CASES(NORM, O)
#undef NORM
  }
}

/* Backward, given the gradient of the output as `count` parts of dtype G (one per projection fed
   by the norm, summed last first in P, as autograd adds them):
     grad_w += d * (x * rstd)                                          (float partial sums per thread)
     g = (d * w) rounded to P then X;  k = (-0.5 * sum(g * x) * rstd^3) / C
     grad_x = g * rstd + k * (2 * x)                                   (rounded to X) */
static inline __attribute__((always_inline)) void rms_norm_backward_rows(
    const int64_t lo, const int64_t hi, const int64_t C, const int64_t count, const void *const *parts,
    const void *x, const void *w, const float *rstd, void *grad_x, float *grad_w, float *d,
    const int X, const int W, const int P, const int G) {
  for (int64_t r = lo; r < hi; r++) {
    const int64_t at = r * C;
    const float rs = rstd[r];
#pragma omp simd
    for (int64_t c = 0; c < C; c++) d[c] = rounded(load(parts[count - 1], at + c, G), P);
    for (int64_t k = count - 2; k >= 0; k--) {
#pragma omp simd
      for (int64_t c = 0; c < C; c++) d[c] = rounded(d[c] + load(parts[k], at + c, G), P);
    }
    if (grad_w) {
#pragma omp simd
      for (int64_t c = 0; c < C; c++) grad_w[c] += rounded(d[c] * rounded(load(x, at + c, X) * rs, X), P);
    }
    if (grad_x) {
      double dot = 0.0;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; c++) {
        d[c] = rounded(rounded(d[c] * load(w, c, W), P), X);
        dot += (double)(d[c] * load(x, at + c, X));
      }
      const float k = (-0.5f * (float)dot) * (rs * rs * rs) / (float)C;
#pragma omp simd
      for (int64_t c = 0; c < C; c++) store(grad_x, at + c, d[c] * rs + k * (2.0f * load(x, at + c, X)), X);
    }
  }
}

/* grad_x may be NULL; grad_w is NULL or (threads, C) zeros, row t summing thread t's rows; scratch
   holds C floats per thread */
void ropelab_rms_norm_backward(int64_t rows, int64_t C, int64_t count, const int64_t *parts, const void *x,
                               const void *w, const float *rstd, void *grad_x, float *grad_w, float *scratch,
                               int64_t X, int64_t W, int64_t P, int64_t G, int64_t threads) {
#pragma omp parallel num_threads(team(threads, rows * C * (count + 2)))
  {
    SPAN(rows, lo, hi);
    const int64_t id = THREAD_ID;
    float *partial = grad_w ? grad_w + id * C : 0;
    const void *const *addresses = (const void *const *)parts;
#define BACK(X_, W_, P_, G_) rms_norm_backward_rows(lo, hi, C, count, addresses, x, w, rstd, grad_x, partial, \
                                                    scratch + id * C, X_, W_, P_, G_)
    DTYPE_CASES(BACK, G)
#undef BACK
  }
}
"""

@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled loops, or None (disabled, no compiler, or the build failed: a warning says why)."""
    I, F, P = I64, F32, ADDRESS
    return load(SOURCE, "layers_cpu", "CPU layer kernels", {
        "ropelab_swiglu": [I, P, P, P, I, I],
        "ropelab_swiglu_backward": [I, P, P, P, P, P, P, I, I],
        "ropelab_add_widened": [I, P, P, P, I, I],
        "ropelab_rms_norm": [I, I, P, P, P, P, I, F, I, I, I, I, I],
        "ropelab_rms_norm_backward": [I, I, I, P, P, P, P, P, P, P, I, I, I, I, I],
    })


def _runs(*tensors: torch.Tensor) -> Optional[ctypes.CDLL]:
    """The library, if it can run on `tensors` (`native.runs_on`); else None."""
    return library() if runs_on(*tensors) else None


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _elementwise(x: torch.Tensor, other: torch.Tensor, out: Optional[torch.Tensor], other_dtypes
                 ) -> Optional[tuple[ctypes.CDLL, torch.Tensor]]:
    """The library and the output (`out`, else a new tensor like x) of a loop over x and `other` of x's
    shape, `other` in one of `other_dtypes` and the output in x's dtype; None where the loop does not apply."""
    lib = _runs(x, other) if out is None else _runs(x, other, out)
    if lib is None or other.dtype not in other_dtypes or other.shape != x.shape:
        return None
    if out is not None and (out.dtype != x.dtype or out.shape != x.shape):
        return None
    return lib, torch.empty_like(x) if out is None else out


def swiglu_loop(gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """silu(gate) * up in their dtype, into `out` if given (which may be gate itself: each element is read
    before it is written), or None where the loop does not apply (then run torch)."""
    ready = _elementwise(gate, up, out, (gate.dtype,))
    if ready is None:
        return None
    lib, hidden = ready
    lib.ropelab_swiglu(gate.numel(), gate.data_ptr(), up.data_ptr(), hidden.data_ptr(), DTYPES[gate.dtype],
                       torch.get_num_threads())
    return hidden


def swiglu_backward_loop(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, with_hidden: bool
                    ) -> Optional[tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]]:
    """(silu(gate) * up or None, grad_gate, grad_up) for the gradient `grad` of silu(gate) * up, all in
    gate's dtype; None where the loop does not apply."""
    lib = _runs(gate, up, grad)
    if lib is None or not gate.dtype == up.dtype == grad.dtype or not gate.shape == up.shape == grad.shape:
        return None
    hidden = torch.empty_like(gate) if with_hidden else None
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(gate)
    lib.ropelab_swiglu_backward(gate.numel(), gate.data_ptr(), up.data_ptr(), grad.data_ptr(), _ptr(hidden),
                                grad_gate.data_ptr(), grad_up.data_ptr(), DTYPES[gate.dtype], torch.get_num_threads())
    return hidden, grad_gate, grad_up


def add_widened_loop(x: torch.Tensor, part: torch.Tensor, out: Optional[torch.Tensor] = None
                     ) -> Optional[torch.Tensor]:
    """x + part in one pass for a float32 x and a part of its shape in float32 or bfloat16, into `out` (a new
    tensor, or x itself: x += part); torch would copy a bf16 part to float32 first. The same bits. None,
    having done nothing, where the loop does not apply."""
    ready = _elementwise(x, part, out, tuple(DTYPES)) if x.dtype == torch.float32 else None
    if ready is None:
        return None
    lib, out = ready
    lib.ropelab_add_widened(x.numel(), x.data_ptr(), part.data_ptr(), out.data_ptr(), DTYPES[part.dtype],
                            torch.get_num_threads())
    return out


def _norm_args(x: torch.Tensor, weight: torch.Tensor) -> Optional[ctypes.CDLL]:
    lib = _runs(x, weight)
    if lib is None or weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        return None
    return lib


def rms_norm_loop(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             rstd: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(weight * (x * rstd) in `out_dtype`, rstd (..., 1) float32) as `ropelab.layers` computes them,
    reusing a given rstd (backward's recomputation); None where the loop does not apply."""
    lib = _norm_args(x, weight)
    if lib is None or out_dtype not in DTYPES or (rstd is not None and not rstd.is_contiguous()):
        return None
    out = torch.empty(x.shape, dtype=out_dtype)
    reuse = rstd is not None
    if not reuse:
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32)
    promoted = torch.promote_types(weight.dtype, x.dtype)
    lib.ropelab_rms_norm(x.numel() // x.shape[-1], x.shape[-1], x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                         rstd.data_ptr(), int(reuse), eps, DTYPES[x.dtype], DTYPES[weight.dtype], DTYPES[promoted],
                         DTYPES[out_dtype], torch.get_num_threads())
    return out, rstd


def rms_norm_backward_loop(parts: Sequence[torch.Tensor], x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      need_x: bool, need_weight: bool
                      ) -> Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """Gradients of x and weight of RMSNorm's output weight * (x * rstd), given that output's gradient as
    the sum of `parts` (each of x's shape and one dtype, added last first as autograd adds them);
    None where the loop does not apply."""
    lib = _norm_args(x, weight)
    if (lib is None or not parts or _runs(rstd, *parts) is None or len({p.dtype for p in parts}) != 1
            or any(p.shape != x.shape for p in parts)):
        return None
    threads, width = torch.get_num_threads(), x.shape[-1]
    promoted = torch.promote_types(weight.dtype, x.dtype)
    grad_x = torch.empty_like(x) if need_x else None
    partials = torch.zeros(threads, width) if need_weight else None
    scratch = torch.empty(threads, width)
    addresses = (ctypes.c_int64 * len(parts))(*(p.data_ptr() for p in parts))
    lib.ropelab_rms_norm_backward(x.numel() // width, width, len(parts), addresses, x.data_ptr(), weight.data_ptr(),
                                  rstd.data_ptr(), _ptr(grad_x), _ptr(partials), scratch.data_ptr(), DTYPES[x.dtype],
                                  DTYPES[weight.dtype], DTYPES[promoted], DTYPES[parts[0].dtype], threads)
    grad_weight = None if partials is None else partials.sum(0).to(promoted).to(weight.dtype)
    return grad_x, grad_weight
