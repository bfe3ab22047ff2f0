"""Document-masked attention: forward + backward of one packed window, backends side by side.

    python benchmarks/attention.py                      # 16,384 tokens of 256-token documents, 8 heads x 64
    python benchmarks/attention.py --heads 2 --kv-heads 1 --doc-len 512 --threads 1
    python benchmarks/attention.py --mixed              # document lengths drawn from [doc_len/2, 3*doc_len/2)

Methods (the same q/k/v values, timed in rotating order, median of the repeats):
  varlen  attend(..., backend="varlen"): documents grouped by length, one causal SDPA per group
  dense   attend(..., backend="dense"): SDPA with the window's (T x T) boolean document mask
  batch   the documents as a plain (n_docs, H, doc_len, D) causal SDPA batch, no mask at all
          (with --mixed it stays T/doc_len documents of doc_len: the same tokens, ideally shaped)
q/k/v are (1, T, H, D).transpose(1, 2) views, as the model's projections produce them; building
the document boundaries (varlen) or the mask (dense) from doc_ids is inside the timer. Backward is
`torch.autograd.grad` of the output against a fixed upstream gradient. Prints a table and the
issue's two ratios, then ONE JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ropelab.attention import Documents, attend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7, help="repeats of varlen and batch")
    parser.add_argument("--dense-reps", type=int, default=3, help="repeats of dense (tens of seconds each at 16k)")
    parser.add_argument("--mixed", action="store_true", help="varlen and dense see documents of random lengths (same mean)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    T, L, H, K, D = args.tokens, args.doc_len, args.heads, args.kv_heads, args.head_dim
    if T % L:
        parser.error("--tokens must be a multiple of --doc-len")
    n = T // L
    gen = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, T, h, D, generator=gen) for h in (H, K, K))
    upstream = torch.randn(1, H, T, D, generator=gen)
    if args.mixed:
        lengths = torch.randint(L // 2, L + L // 2, (2 * n,), generator=gen)
        lengths = lengths[: int((lengths.cumsum(0) < T).sum()) + 1]
        lengths[-1] -= int(lengths.sum()) - T
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths).unsqueeze(0)
    else:
        doc_ids = (torch.arange(T) // L).unsqueeze(0)
    documents = int(doc_ids.max()) + 1

    def packed(backend):
        q, k, v = (x.clone().transpose(1, 2).requires_grad_() for x in (q0, k0, v0))

        def run():
            out = attend(q, k, v, Documents(doc_ids), backend)
            torch.autograd.grad(out, (q, k, v), upstream)
        return run

    def batch():
        q, k, v = (x.clone().view(n, L, x.shape[2], D).transpose(1, 2).requires_grad_() for x in (q0, k0, v0))
        grad = upstream.view(H, n, L, D).transpose(0, 1)

        def run():
            out = attend(q, k, v)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    methods = {"varlen": packed("varlen"), "dense": packed("dense"), "batch": batch()}
    reps = {"varlen": args.reps, "dense": args.dense_reps, "batch": args.reps}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for name, run in methods.items():  # warm-up
        run()
    for round_index in range(max(reps.values())):
        for name, run in methods.items():
            if round_index < reps[name]:
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}

    shape = f"{documents} documents of {L // 2}-{L + L // 2 - 1} tokens (batch: {n} x {L})" if args.mixed else f"{n} documents x {L}"
    print(f"window {T:,} tokens = {shape}; q heads {H}, kv heads {K}, head_dim {D}; fp32; "
          f"threads {torch.get_num_threads()}; forward + backward")
    print(f"{'method':<8} {'median s':>10} {'reps':>5}")
    for name in methods:
        print(f"{name:<8} {median[name]:>10.3f} {len(times[name]):>5}")
    speedup = median["dense"] / median["varlen"]
    overhead = median["varlen"] / median["batch"]
    print(f"dense / varlen = {speedup:.1f}x   (target >= 5x)")
    print(f"varlen / batch = {overhead:.2f}x   (target <= 1.5x)")
    print(json.dumps({
        "benchmark": "attention_doc_mask", "tokens": T, "doc_len": L, "mixed": args.mixed, "documents": documents, "heads": H, "kv_heads": K, "head_dim": D,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "median_s": {k: round(v, 4) for k, v in median.items()}, "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "dense_over_varlen": round(speedup, 2), "varlen_over_batch": round(overhead, 3),
    }))


if __name__ == "__main__":
    main()
