"""Document-masked and windowed attention: forward + backward of one packed window, backends side by side.

    python benchmarks/attention.py                      # 16,384 tokens of 256-token documents, 8 heads x 64
    python benchmarks/attention.py --heads 2 --kv-heads 1 --doc-len 512 --threads 1
    python benchmarks/attention.py --mixed              # document lengths drawn from [doc_len/2, 3*doc_len/2)
    python benchmarks/attention.py --windows            # sliding windows 128..2048 of 4,096 tokens vs full (~30 s)
    python benchmarks/attention.py --windows 256 1024 --window-kind chunked --window-tokens 8192
    python benchmarks/attention.py --causal-cost --heads 9 --kv-heads 3   # SmolLM2's heads (~20 s)
    python benchmarks/attention.py --products --heads 9 --kv-heads 3      # the fused kernel against its parts (~10 s)

Methods (the same q/k/v values, timed in rotating order, median of the repeats):
  varlen  attend(..., backend="varlen"): documents grouped by length, one causal SDPA per group
  dense   attend(..., backend="dense"): SDPA with the window's (T x T) boolean document mask
  batch   the documents as a plain (n_docs, H, doc_len, D) causal SDPA batch, no mask at all
          (with --mixed it stays T/doc_len documents of doc_len: the same tokens, ideally shaped)
q/k/v are (1, T, H, D).transpose(1, 2) views, as the model's projections produce them; building
the document boundaries (varlen) or the mask (dense) from doc_ids is inside the timer. Backward is
`torch.autograd.grad` of the output against a fixed upstream gradient. Prints a table and the
issue's two ratios, then ONE JSON line with every figure.

With --windows, one row of --window-tokens tokens (no documents) per window size W instead:
  full    attend(...): causal SDPA, no window (the row W = T, and the ratios' denominator)
  auto    attend(..., window=(kind, W)): the blocked local kernel where it is cheaper, else `masked`
  masked  attend(..., backend="sdpa", window=(kind, W)): one SDPA call with a (T x T) window mask

With --causal-cost, causal SDPA against the same call without the mask (`full`) at each length, batch
--causal-tokens // T: what a kernel saves by skipping the masked half of the scores. causal / full is
about 0.5 where it skips all of them, 1.0 where it computes every score and masks them afterwards.
(PyTorch's CPU flash kernel skips whole key blocks of 512, so at 512 tokens and less it skips none.)

With --products T (default 512), batch --causal-tokens // T, in fp32 and (on a CPU with native bf16) bf16,
how much of PyTorch's fused causal attention is matrix products: the kernel's forward + backward
(`kernel`) against its seven products alone as batched GEMMs over the whole T x T square, as the CPU
kernel computes it at 512 tokens and less (`products`: QK^T and PV; in backward QK^T again, dO V^T,
P^T dO, dS K and dS^T Q) and its softmax work as separate ops (`softmax`: scale, causal mask and
softmax in fp32 and back, then P * (dP - rowsum(P * dP))). benchmarks/real_model.py's GEMM floor
counts the kernel either as overhead or as products; this says which is nearer the truth per dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ropelab.attention import Documents, attend, resolve_backend
from ropelab.attention_windows import check_window, sdpa
from ropelab.machine import cpu_kind


def timed(methods: dict, reps: dict) -> dict[str, list[float]]:
    """Seconds of every run: one warm-up each, then the methods in rotating order."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for run in methods.values():
        run()
    for round_index in range(max(reps.values())):
        for name, run in methods.items():
            if round_index < reps[name]:
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=None, help="repeats of varlen and batch (default 7); "
                        "with --windows of full and auto (default 3)")
    parser.add_argument("--dense-reps", type=int, default=None, help="repeats of dense (default 3, tens of seconds "
                        "each at 16k); with --windows of masked (default 2)")
    parser.add_argument("--mixed", action="store_true", help="varlen and dense see documents of random lengths (same mean)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--windows", type=int, nargs="*", default=None,
                        help="window sizes to time instead of documents (no sizes: 128 512 1024 2048)")
    parser.add_argument("--window-kind", choices=("sliding", "chunked"), default="sliding")
    parser.add_argument("--window-tokens", type=int, default=4096)
    parser.add_argument("--causal-cost", type=int, nargs="*", default=None, metavar="T",
                        help="lengths at which to time causal against unmasked SDPA (no lengths: 256 512 1024 2048)")
    parser.add_argument("--causal-tokens", type=int, default=2048,
                        help="tokens per --causal-cost or --products call (batch x T)")
    parser.add_argument("--products", type=int, nargs="?", const=512, default=None, metavar="T",
                        help="time the fused causal kernel against its products and its softmax at T tokens (512)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.products is not None:
        args.reps = args.reps or 7
        kernel_parts(args)
    elif args.causal_cost is not None:
        args.reps = args.reps or 5
        causal_cost(args)
    elif args.windows is not None:
        args.reps, args.dense_reps = args.reps or 3, args.dense_reps or 2
        window_sweep(args)
    else:
        args.reps, args.dense_reps = args.reps or 7, args.dense_reps or 3
        documents_benchmark(args, parser)


def documents_benchmark(args, parser) -> None:
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
    times = timed(methods, {"varlen": args.reps, "dense": args.dense_reps, "batch": args.reps})
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
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_kind(),
        "median_s": {k: round(v, 4) for k, v in median.items()}, "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "dense_over_varlen": round(speedup, 2), "varlen_over_batch": round(overhead, 3),
    }))


def window_sweep(args) -> None:
    T, H, K, D, kind = args.window_tokens, args.heads, args.kv_heads, args.head_dim, args.window_kind
    sizes = sorted({w for w in (args.windows or [128, 512, 1024, 2048]) if w < T})
    gen = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, T, h, D, generator=gen) for h in (H, K, K))
    upstream = torch.randn(1, H, T, D, generator=gen)

    def method(backend="auto", window=None):
        q, k, v = (x.clone().transpose(1, 2).requires_grad_() for x in (q0, k0, v0))

        def run():
            out = attend(q, k, v, None, backend, window)
            torch.autograd.grad(out, (q, k, v), upstream)
        return run

    methods, reps = {"full": method()}, {"full": args.reps}
    for w in sizes:
        methods[f"auto@{w}"], reps[f"auto@{w}"] = method("auto", (kind, w)), args.reps
        methods[f"masked@{w}"], reps[f"masked@{w}"] = method("sdpa", (kind, w)), args.dense_reps
    median = {name: statistics.median(t) for name, t in timed(methods, reps).items()}
    full = median["full"]
    picked = {w: resolve_backend("auto", None, torch.device("cpu"), check_window((kind, w), T), T) for w in sizes}

    print(f"{kind} windows over {T:,} tokens, no documents; q heads {H}, kv heads {K}, head_dim {D}; fp32; "
          f"threads {torch.get_num_threads()}; forward + backward; median of {args.reps} (masked: {args.dense_reps})")
    print(f"{'W':>6} {'auto runs':>9} {'auto s':>8} {'/ full':>7} {'masked s':>9} {'/ full':>7}")
    for w in sizes:
        auto, masked = median[f"auto@{w}"], median[f"masked@{w}"]
        print(f"{w:>6} {picked[w]:>9} {auto:>8.3f} {auto / full:>7.2f} {masked:>9.3f} {masked / full:>7.2f}")
    print(f"{T:>6} {'full':>9} {full:>8.3f} {1:>7.2f}")
    print(json.dumps({
        "benchmark": "attention_windows", "tokens": T, "kind": kind, "heads": H, "kv_heads": K, "head_dim": D,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": cpu_kind(), "auto_backend": {str(w): picked[w] for w in sizes},
        "median_s": {k: round(v, 4) for k, v in median.items()},
        "over_full": {k: round(v / full, 3) for k, v in median.items()},
    }))


def causal_cost(args) -> None:
    H, K, D = args.heads, args.kv_heads, args.head_dim
    lengths = sorted(set(args.causal_cost or [256, 512, 1024, 2048]))
    gen = torch.Generator().manual_seed(0)

    def method(batch: int, T: int, causal: bool):
        q, k, v = (torch.randn(batch, h, T, D, generator=gen).requires_grad_() for h in (H, K, K))
        upstream = torch.randn(batch, H, T, D, generator=gen)

        def run():
            torch.autograd.grad(sdpa(q, k, v, None, causal), (q, k, v), upstream)
        return run

    batches = {T: max(1, args.causal_tokens // T) for T in lengths}
    methods = {f"{name}@{T}": method(batches[T], T, name == "causal") for T in lengths for name in ("causal", "full")}
    median = {name: statistics.median(t) for name, t in timed(methods, dict.fromkeys(methods, args.reps)).items()}
    ratio = {T: median[f"causal@{T}"] / median[f"full@{T}"] for T in lengths}

    cpu = cpu_kind()
    print(f"causal against unmasked SDPA; q heads {H}, kv heads {K}, head_dim {D}; fp32; threads "
          f"{torch.get_num_threads()}; forward + backward; median of {args.reps}; CPU {cpu['model_name']} "
          f"({cpu['torch_cpu_capability']})")
    print(f"{'T':>6} {'batch':>6} {'causal s':>9} {'full s':>8} {'causal / full':>14}")
    for T in lengths:
        print(f"{T:>6} {batches[T]:>6} {median[f'causal@{T}']:>9.4f} {median[f'full@{T}']:>8.4f} {ratio[T]:>14.2f}")
    print(json.dumps({
        "benchmark": "attention_causal_cost", "heads": H, "kv_heads": K, "head_dim": D, "batches": batches,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu,
        "median_s": {k: round(v, 5) for k, v in median.items()},
        "causal_over_full": {str(T): round(r, 3) for T, r in ratio.items()},
    }))


def kernel_parts(args) -> None:
    T, H, K, D = args.products, args.heads, args.kv_heads, args.head_dim
    if H % K:
        raise SystemExit(f"--heads {H} must be a multiple of --kv-heads {K}")
    B = max(1, args.causal_tokens // T)
    gen = torch.Generator().manual_seed(0)
    cpu = cpu_kind()
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu["native_bf16"] else [])
    methods = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        q, k, v = (torch.randn(B, h, T, D, generator=gen).to(dtype).requires_grad_() for h in (H, K, K))
        upstream = torch.randn(B, H, T, D, generator=gen).to(dtype)

        def kernel(q=q, k=k, v=v, upstream=upstream):
            torch.autograd.grad(sdpa(q, k, v, None, True), (q, k, v), upstream)

        # every query head against its own copy of its group's keys and values: the same products per head
        qs, ks, vs = (x.detach().repeat_interleave(H // x.shape[1], 1).reshape(B * H, T, D) for x in (q, k, v))
        grad = upstream.reshape(B * H, T, D)
        scores = torch.randn(B * H, T, T, generator=gen).to(dtype)

        def products(qs=qs, ks=ks, vs=vs, grad=grad, scores=scores):
            torch.bmm(qs, ks.transpose(1, 2)), torch.bmm(scores, vs)
            torch.bmm(qs, ks.transpose(1, 2)), torch.bmm(grad, vs.transpose(1, 2))
            torch.bmm(scores.transpose(1, 2), grad), torch.bmm(scores, ks), torch.bmm(scores.transpose(1, 2), qs)

        masked = ~torch.ones(T, T, dtype=torch.bool).tril()

        def softmax(scores=scores, dtype=dtype):
            p = torch.softmax(scores.float().mul_(D ** -0.5).masked_fill_(masked, float("-inf")), -1)
            p.to(dtype)
            dp = scores.float()
            (p * (dp - (p * dp).sum(-1, keepdim=True))).to(dtype)

        methods.update({f"kernel/{name}": kernel, f"products/{name}": products, f"softmax/{name}": softmax})
    median = {key: statistics.median(t) for key, t in timed(methods, dict.fromkeys(methods, args.reps)).items()}

    print(f"causal attention at {T} tokens x batch {B}; q heads {H}, kv heads {K}, head_dim {D}; threads "
          f"{torch.get_num_threads()}; forward + backward; median of {args.reps}; CPU {cpu['model_name']} "
          f"({cpu['torch_cpu_capability']}, native bf16: {'yes' if cpu['native_bf16'] else 'no, bf16 not measured'})")
    print(f"{'dtype':<9} {'kernel ms':>10} {'products ms':>12} {'softmax ms':>11} {'products / kernel':>18}")
    shares = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        kernel_ms, products_ms, softmax_ms = (median[f"{part}/{name}"] * 1e3 for part in ("kernel", "products", "softmax"))
        shares[name] = round(products_ms / kernel_ms, 3)
        print(f"{name:<9} {kernel_ms:>10.1f} {products_ms:>12.1f} {softmax_ms:>11.1f} {shares[name]:>18.2f}")
    print(json.dumps({
        "benchmark": "attention_kernel_parts", "tokens": T, "batch": B, "heads": H, "kv_heads": K, "head_dim": D,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu,
        "median_s": {key: round(value, 5) for key, value in median.items()}, "products_over_kernel": shares,
    }))


if __name__ == "__main__":
    main()
