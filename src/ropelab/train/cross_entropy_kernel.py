"""One-pass C loop for the chunked cross-entropy of `ropelab.train.loss` on CPU.

Why: without a teacher, each chunk of the loss is a softmax over (tokens, V) logits and its gradient.
In torch that is a cast of the logits to fp32, then max, subtract, exp, sum, scale and, under
autocast, a cast of the gradient back to bf16: seven passes over 256 x 49,152 values per chunk,
20% of what a SmolLM2-135M step spends outside its matrix products (BENCHMARKS.md, "GEMM floor").
This loop reads each row of logits in their own dtype, keeps it in cache for its three passes (max,
sum of exp, gradient; the exps kept in a float row of their own between the last two) and writes the
gradient over the logits, in the head's dtype.

Numbers: the same float32 expressions as `loss._ce_chunk` (lse = log(sum(exp(z - max))) + max; the
gradient exp(z - max) * ((w_ce + 2 w_z lse) * scale / sum), minus w_ce * scale at the label) but
with `ropelab.native`'s exp and its own sum (float blocks of 512 added in double; torch adds
pairwise), so the loss and the gradient are within a few float32 roundings of the torch path's
(tests/train/test_cross_entropy_kernel.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from ropelab.native import ADDRESS, DTYPES, F32, I64, PRELUDE, load, runs_on

SOURCE = PRELUDE + r"""
/* exp of a row's logits kept in `e` (V floats, this thread's) between the sum and the gradient */
static inline __attribute__((always_inline)) void rows_ce(
    const int64_t lo, const int64_t hi, const int64_t V, void *logits, const int64_t *labels, float *lse,
    float *picked, const int with_grad, const float w_ce, const float w_z2, const float scale, const float label_term,
    float *e, const int Z) {
  for (int64_t r = lo; r < hi; r++) {
    const int64_t at = r * V;
    float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
    for (int64_t v = 0; v < V; v++) {
      const float z = load(logits, at + v, Z);
      peak = z > peak ? z : peak;
    }
    /* float sums of 512 terms, added in double: one float sum of 49k terms in 16 lanes drifts by 1e-5 */
    double sum = 0.0;
    for (int64_t start = 0; start < V; start += 512) {
      const int64_t stop = start + 512 < V ? start + 512 : V;
      float part = 0.0f;
#pragma omp simd reduction(+ : part)
      for (int64_t v = start; v < stop; v++) {
        e[v] = exp_of(load(logits, at + v, Z) - peak);
        part += e[v];
      }
      sum += part;
    }
    const float total = (float)sum;
    const float row_lse = logf(total) + peak, label_logit = load(logits, at + labels[r], Z);
    lse[r] = row_lse;
    picked[r] = label_logit;
    if (!with_grad) continue;
    const float factor = ((w_ce + w_z2 * row_lse) * scale) / total;
#pragma omp simd
    for (int64_t v = 0; v < V; v++) store(logits, at + v, e[v] * factor, Z);
    store(logits, at + labels[r], e[labels[r]] * factor - label_term, Z);
  }
}

/* Per row of logits (n, V) of dtype Z (1: bf16): lse and the label's logit, and (with_grad) the
   gradient written over the row, in Z; every label in [0, V) (the caller checks); scratch: V floats
   per thread */
void ropelab_cross_entropy(int64_t n, int64_t V, void *logits, const int64_t *labels, float *lse, float *picked,
                           int64_t with_grad, float w_ce, float w_z2, float scale, float label_term, float *scratch,
                           int64_t Z, int64_t threads) {
#pragma omp parallel num_threads(team(threads, n * V))
  {
    SPAN(n, lo, hi);
    float *e = scratch + THREAD_ID * V;
    if (Z) rows_ce(lo, hi, V, logits, labels, lse, picked, (int)with_grad, w_ce, w_z2, scale, label_term, e, 1);
    else rows_ce(lo, hi, V, logits, labels, lse, picked, (int)with_grad, w_ce, w_z2, scale, label_term, e, 0);
  }
}
"""

@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled loops, or None (disabled, no compiler, or the build failed: a warning says why)."""
    I, F, P = I64, F32, ADDRESS
    return load(SOURCE, "cross_entropy_cpu", "CPU cross-entropy kernel", {
        "ropelab_cross_entropy": [I, I, P, P, P, P, I, F, F, F, F, P, I, I],
    })


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, w_ce: float, w_z: float, grad_scale: Optional[float]
             ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """`loss._ce_chunk` on (n, V) logits of float32 or bfloat16, in the loop: (sums of (0, CE, lse^2),
    the gradient written over `logits`, or None without `grad_scale` or weights). None where the loop
    does not apply (then run `_ce_chunk`): not a contiguous 2-D CPU tensor of those dtypes, under
    torch.compile, or a label outside [0, V), for which torch's own indexing raises its error."""
    lib = library()
    if (lib is None or not runs_on(logits) or logits.dim() != 2 or labels.dtype != torch.int64
            or labels.device.type != "cpu" or labels.shape != logits.shape[:1]):
        return None
    n, vocab = logits.shape
    labels = labels.contiguous()
    if n and not 0 <= int(labels.min()) <= int(labels.max()) < vocab:
        return None
    with_grad = grad_scale is not None and bool(w_ce or w_z)
    scale = grad_scale if with_grad else 0.0
    lse, picked = torch.empty(n), torch.empty(n)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, vocab)
    lib.ropelab_cross_entropy(n, vocab, logits.data_ptr(), labels.data_ptr(), lse.data_ptr(), picked.data_ptr(),
                              int(with_grad), w_ce, 2 * w_z, scale, w_ce * scale, scratch.data_ptr(),
                              DTYPES[logits.dtype], threads)
    sums = torch.stack([lse.new_zeros(()), (lse - picked).sum(), lse.square().sum()])
    return sums, logits if with_grad else None
