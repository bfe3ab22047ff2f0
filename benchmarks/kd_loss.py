"""Distillation loss micro-benchmark: chunked `kd_loss` against the direct full-logits computation.

    python benchmarks/kd_loss.py                       # 1 x 2048 tokens, vocab 32768, d 256, chunk 512
    python benchmarks/kd_loss.py --tokens 4096 --vocab 50304 --threads 1

Methods (forward + backward of KD with T = 2, alpha = 1, wrt the student's hidden states and head):
  chunked        kd_loss, full vocabulary, `--chunk` tokens at a time
  chunked_top64  kd_loss with 64 sparse teacher targets plus the rest bucket
  direct         student and teacher logits for all tokens in fp32, log_softmax, F.kl_div, autograd

Peak memory: each method runs once in a fresh subprocess, and the figure is the growth of the
process's peak resident set (VmHWM in /proc/self/status, Linux; ru_maxrss would carry the parent's
peak across exec) over its value after the inputs were built. Time: all
methods in one process, in rotating order, median of --reps after one warm-up round. The chunked
and direct losses and gradients are compared first. Prints a table and the ratios, then ONE JSON
line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ropelab.train.loss import TeacherHidden, kd_loss

METHODS = ("chunked", "chunked_top64", "direct")
TEMPERATURE = 2.0


def make_inputs(args):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.dim, generator=g)
    head = torch.randn(args.vocab, args.dim, generator=g) * args.dim ** -0.5
    teacher = TeacherHidden(torch.randn(1, args.tokens, args.dim, generator=g),
                            torch.randn(args.vocab, args.dim, generator=g) * args.dim ** -0.5)
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    return hidden, head, teacher, labels


def run(method: str, args, hidden, head, teacher, labels):
    """One forward + backward; returns (loss, grad of hidden, grad of head)."""
    h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    if method == "direct":
        zs, zt = (h @ w.T).flatten(0, 1), teacher.logits(torch.arange(args.tokens))
        logq, logp = F.log_softmax(zs / TEMPERATURE, -1), F.log_softmax(zt / TEMPERATURE, -1)
        loss = TEMPERATURE ** 2 * F.kl_div(logq, logp, log_target=True, reduction="batchmean")
    else:
        top_k = 64 if method == "chunked_top64" else None
        loss = kd_loss(h, w, labels, teacher, TEMPERATURE, 1.0, top_k, args.chunk).loss
    loss.backward()
    return loss.detach(), h.grad, w.grad


def peak_bytes(method: str, args) -> int:
    """Growth of the peak RSS of a fresh process running `method` once."""
    argv = [sys.executable, __file__, "--worker", method, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
            "--dim", str(args.dim), "--chunk", str(args.chunk), "--threads", str(torch.get_num_threads())]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def peak_rss() -> int:
    """This process's peak resident set in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(args) -> None:
    inputs = make_inputs(args)
    before = peak_rss()
    run(args.worker, args, *inputs)
    print(peak_rss() - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args)

    inputs = make_inputs(args)
    ref, chunked = run("direct", args, *inputs), run("chunked", args, *inputs)
    diffs = {name: (a - b).abs().max().item() for name, a, b in zip(("loss", "grad_hidden", "grad_head"), chunked, ref)}
    logits_bytes = args.tokens * args.vocab * 4
    peaks = {m: peak_bytes(m, args) for m in METHODS}
    times = {m: [] for m in METHODS}
    for i in range(1 + args.reps):
        for m in METHODS[i % 3:] + METHODS[: i % 3]:
            t0 = time.perf_counter()
            run(m, args, *inputs)
            if i:
                times[m].append(time.perf_counter() - t0)
    medians = {m: statistics.median(t) for m, t in times.items()}

    print(f"{args.tokens} tokens, vocab {args.vocab}, dim {args.dim}, chunk {args.chunk}, T={TEMPERATURE}; "
          f"one fp32 (tokens x vocab) tensor = {logits_bytes / 2**20:.0f} MiB; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("chunked vs direct, max abs diff: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    print(f"{'method':<14} {'peak extra MiB':>15} {'x logits':>9} {'fwd+bwd s':>10}")
    for m in METHODS:
        print(f"{m:<14} {peaks[m] / 2**20:15.0f} {peaks[m] / logits_bytes:9.2f} {medians[m]:10.3f}")
    ratios = {"peak_direct_over_chunked": round(peaks["direct"] / peaks["chunked"], 2),
              "time_chunked_over_direct": round(medians["chunked"] / medians["direct"], 3),
              "time_top64_over_direct": round(medians["chunked_top64"] / medians["direct"], 3)}
    print("ratios: " + ", ".join(f"{k} {v}" for k, v in ratios.items()))
    print(json.dumps({"benchmark": "kd_loss", "tokens": args.tokens, "vocab": args.vocab, "dim": args.dim,
                      "chunk": args.chunk, "threads": torch.get_num_threads(), "reps": args.reps,
                      "torch": torch.__version__, "max_abs_diff": diffs, "logits_bytes": logits_bytes,
                      "peak_bytes": peaks, "median_s": {m: round(t, 4) for m, t in medians.items()},
                      "ratios": ratios}))


if __name__ == "__main__":
    main()
