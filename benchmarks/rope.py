"""Partial RoPE micro-benchmark: forward + backward of q and k, side by side in one process.

    python benchmarks/rope.py                   # llama-3.2-1b heads: q (1, 32, 2048, 64), k (1, 8, 2048, 64)
    python benchmarks/rope.py --batch 2 --threads 1 --dtype bf16
    python benchmarks/rope.py --keep-pairs 8 2  # selected-pair plans keeping 8 and 2 pairs (default 32 16 4)

Methods (each timed on the same fresh inputs, in rotating order, median of --reps):
  ropelab      RotaryEmbedding.forward (cache=table) -> the in-place fast path `PartialRotary`, which
               rotates with the C kernel `rope.cpu_kernel` (one loop over q and k)
  ropelab_torch  the same with the C kernel switched off: `rope.kernels.rotate_`, eager PyTorch ops
  ropelab_ref  the same module with inplace=False -> out-of-place reference `apply_partial_rope`
  hf_neox      transformers GPT-NeoX `apply_rotary_pos_emb` (slices, rotates, concatenates)
  hf_llama     transformers Llama `apply_rotary_pos_emb` (full rotation; fraction 1.0 only)
  copy         q -> preallocated q', k -> k' (one read + one write of q and k; no backward)
  touch        the memory floor of one direction (fp32, needs a C compiler): a plain C loop that
               reads and writes back the rotated channels of every row of q and k in place, with
               the kernel's prefetch hint and threads, and no arithmetic or angles. Its
               time(0.1) / time(1.0) is what the memory system allows for that ratio.
Selected-pair plans (`ropelab.rope.pairs`), one per --keep-pairs r of the head_dim/2 pairs, rows @r:
  plan_shared      every KV head keeps the same r pairs (select uniform): one (positions, r) table,
                   the fast path and C kernel of partial RoPE with rotary_dims 2r
  plan_shared_torch  the same with the C kernel switched off (eager torch ops)
  plan_per_head    each KV head keeps its own r pairs (KV head h: uniform's pairs shifted by h): no
                   table, K x r angles formed per call, the eager per-head rotation `rotate_`

q and k are fresh non-leaf tensors (clones of leaves, made outside the timer, after the incoming
gradients, so that they are as warm in cache as a projection's output), and backward is
`torch.autograd.grad` to their gradient edges, so it runs exactly the RoPE nodes. cos/sin are built
outside the timer for HF (HF builds them once per model forward); ropelab's table lookup is timed.
Prints a table, the ratios of the issue's targets (each the median of per-repetition ratios, so that
load from other processes moves numerator and denominator together), then ONE JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import platform
import statistics
import subprocess
import time

import torch
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as hf_neox_apply
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_llama_apply

from ropelab import native
from ropelab.config import RopeConfig
from ropelab.config import resolve_rotary_dims
from ropelab.rope import RotaryEmbedding
from ropelab.rope import cpu_kernel as rope_cpu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOUCH_SOURCE = r"""
#include <stdint.h>
/* Read and write back the first n of every `width` floats of x (rows of q or k) in place. */
void touch(float *x, int64_t rows, int64_t width, int64_t n, int64_t threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    float *row = x + r * width;
    if (n < width) __builtin_prefetch(row + 32 * width, 1);
    for (int64_t i = 0; i < n; i++) row[i] = row[i] * 1.0001f;
  }
}
"""


def touch_loop():
    """`touch` compiled as rope_cpu's kernel is (same flags, OpenMP), or None without a compiler."""
    compiler = native.c_compiler()
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(native.compile_library(compiler, TOUCH_SOURCE, "rope_touch")))
    except (OSError, subprocess.SubprocessError):
        return None
    lib.touch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return lib.touch


def hf_cos_sin(rotary_dims: int, seq: int, batch: int, theta: float, dtype: torch.dtype):
    """cos/sin as HF's GPT-NeoX/Llama rotary modules return them: (B, T, rotary_dims), model dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dims, 2, dtype=torch.int64).float() / rotary_dims))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos().to(dtype).expand(batch, -1, -1).contiguous(), emb.sin().to(dtype).expand(batch, -1, -1).contiguous())


@contextlib.contextmanager
def torch_path():
    """Within the block the C kernel declines every call, so the fast path rotates with torch ops."""
    library = rope_cpu.library
    rope_cpu.library = lambda: None
    try:
        yield
    finally:
        rope_cpu.library = library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--keep-pairs", type=int, nargs="*", default=[32, 16, 4],
                        help="selected-pair plans: pairs kept per KV head, of head_dim/2 (none: no plan rows)")
    parser.add_argument("--layout", choices=["half", "interleaved"], default="half")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if 1.0 not in args.fractions:
        args.fractions.append(1.0)
    dtype = DTYPES[args.dtype]
    B, H, K, T, D = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    n_pairs = D // 2
    for r in args.keep_pairs:
        if not 1 <= r <= n_pairs:
            parser.error(f"--keep-pairs {r}: must be in 1..{n_pairs} (head_dim {D} has {n_pairs} pairs)")
    if args.keep_pairs and K < 2:
        parser.error(f"--keep-pairs: the per-KV-head plans need --kv-heads >= 2 (got {K})")
    theta = 10_000.0
    gen = torch.Generator().manual_seed(0)
    q_leaf = torch.randn(B, H, T, D, generator=gen).to(dtype)
    k_leaf = torch.randn(B, K, T, D, generator=gen).to(dtype)
    grad_q = torch.randn(B, H, T, D, generator=gen).to(dtype)
    grad_k = torch.randn(B, K, T, D, generator=gen).to(dtype)
    position_ids = torch.arange(T).repeat(B, 1)
    q_copy, k_copy = torch.empty_like(q_leaf), torch.empty_like(k_leaf)

    # One callable per (method, fraction) or (plan method, kept pairs): q, k -> rotated q, k; `torch_only`
    # names the torch-path runs; `dims` the rotated channels of each.
    cases, torch_only, dims = {}, set(), {}
    for fraction in args.fractions:
        r = resolve_rotary_dims(D, fraction)
        if args.layout == "half":  # HF's functions only know the half (rotate_half) layout
            cos, sin = hf_cos_sin(r, T, B, theta, dtype)
            cases[("hf_neox", fraction)] = lambda q, k, cos=cos, sin=sin: hf_neox_apply(q, k, cos, sin)
            dims[("hf_neox", fraction)] = r
            if r == D:
                cases[("hf_llama", fraction)] = lambda q, k, cos=cos, sin=sin: hf_llama_apply(q, k, cos, sin)
                dims[("hf_llama", fraction)] = r
        for name, inplace in (("ropelab", None), ("ropelab_torch", None), ("ropelab_ref", False)):
            rope = RotaryEmbedding(RopeConfig(fraction=fraction, theta=theta, layout=args.layout, cache="table"), D)
            rope.inplace = inplace
            # A new position tensor per call: the module looks its angles up again (a model does
            # so once per forward, shared by its layers), so the lookup is timed every time.
            cases[(name, fraction)] = lambda q, k, rope=rope: rope(q, k, position_ids.clone())
            dims[(name, fraction)] = r
        torch_only.add(("ropelab_torch", fraction))
    plans = {}  # plan key -> its module, for the record's check of which path it took
    for r in args.keep_pairs:
        uniform = [j * n_pairs // r for j in range(r)]
        per_head = [[(i + h) % n_pairs for i in uniform] for h in range(K)]  # KV head h: shifted by h
        for name, plan in (("plan_shared", {"keep_pairs": r, "select": "uniform"}),
                           ("plan_shared_torch", {"keep_pairs": r, "select": "uniform"}),
                           ("plan_per_head", {"pairs": per_head})):
            rope = RotaryEmbedding(RopeConfig(theta=theta, layout=args.layout, cache="table", **plan), D, K)
            cases[(name, r)] = lambda q, k, rope=rope: rope(q, k, position_ids.clone())
            dims[(name, r)] = 2 * r
            plans[(name, r)] = rope
        torch_only.add(("plan_shared_torch", r))

    def run_rope(key):
        grads = (grad_q.clone(), grad_k.clone())  # ropelab's backward writes into its incoming gradient
        # Fresh non-leaf q, k, written last, so they sit in cache as a projection's output would.
        q = q_leaf.detach().requires_grad_().clone()
        k = k_leaf.detach().requires_grad_().clone()
        edges = (torch.autograd.graph.get_gradient_edge(q), torch.autograd.graph.get_gradient_edge(k))
        with torch_path() if key in torch_only else contextlib.nullcontext():
            t0 = time.perf_counter()
            q_out, k_out = cases[key](q, k)
            t1 = time.perf_counter()
            if q_out.requires_grad:
                torch.autograd.grad((q_out, k_out), edges, grads)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t0

    def run_copy(_):
        t0 = time.perf_counter()
        q_copy.copy_(q_leaf)
        k_copy.copy_(k_leaf)
        t1 = time.perf_counter()
        return t1 - t0, t1 - t0

    touch = touch_loop() if dtype == torch.float32 else None
    if touch is not None:
        for fraction in args.fractions:
            cases[("touch", fraction)] = None
            dims[("touch", fraction)] = resolve_rotary_dims(D, fraction)

    def run_touch(key):
        grads = (grad_q.clone(), grad_k.clone())  # the same allocations and writes as run_rope's
        q, k = q_leaf.clone(), k_leaf.clone()
        t0 = time.perf_counter()
        for x in (q, k):
            touch(x.data_ptr(), x.numel() // D, D, dims[key], torch.get_num_threads())
        t1 = time.perf_counter()
        del grads
        return t1 - t0, t1 - t0

    cases[("copy", None)] = None
    dims[("copy", None)] = None
    keys = list(cases)
    samples = {key: ([], []) for key in keys}
    for rep in range(args.warmup + args.reps):
        order = keys[rep % len(keys):] + keys[: rep % len(keys)]  # rotate the order: no method always first
        for key in order:
            run = {"copy": run_copy, "touch": run_touch}.get(key[0], run_rope)
            fwd, total = run(key)
            if rep >= args.warmup:
                samples[key][0].append(fwd)
                samples[key][1].append(total)

    ms = {key: (statistics.median(f) * 1e3, statistics.median(t) * 1e3) for key, (f, t) in samples.items()}
    print(f"q ({B}, {H}, {T}, {D}), k ({B}, {K}, {T}, {D}), {args.dtype}, layout {args.layout}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.reps} reps (ms)")
    print(f"{'method':<17} {'fraction':>8} {'dims':>5} {'fwd':>9} {'fwd+bwd':>9}   (plan rows: kept pairs / pairs)")
    for key, (fwd, total) in ms.items():
        name, fraction = key
        if key in plans:
            fraction = f"{fraction}/{n_pairs}"
        channels = "-" if dims[key] is None else dims[key]
        print(f"{name:<17} {'-' if fraction is None else fraction:>8} {channels:>5} {fwd:9.3f} {total:9.3f}")

    def ratio(a, b, part=1, scale=1.0):
        """Median over repetitions of time(a) / (scale * time(b)), both taken in the same repetition:
        a load change between repetitions moves both, not their ratio. part 0: forward, 1: fwd+bwd."""
        if a not in samples or b not in samples:
            return math.nan
        return statistics.median(x / (scale * y) for x, y in zip(samples[a][part], samples[b][part]))

    copy, low = ("copy", None), min(args.fractions)
    ratios = {
        "hf_neox_over_ropelab_at_0.25": ratio(("hf_neox", 0.25), ("ropelab", 0.25)),
        "ropelab_full_over_copy": ratio(("ropelab", 1.0), copy),
        "ropelab_full_fwd_over_copy": ratio(("ropelab", 1.0), copy, part=0),
        "ropelab_full_over_two_copies": ratio(("ropelab", 1.0), copy, scale=2.0),
        "touch_full_over_copy": ratio(("touch", 1.0), copy),
        "ropelab_full_fwd_over_touch_full": ratio(("ropelab", 1.0), ("touch", 1.0), part=0),
        f"touch_{low}_over_full": ratio(("touch", low), ("touch", 1.0)),
        f"ropelab_{low}_over_full": ratio(("ropelab", low), ("ropelab", 1.0)),
        f"ropelab_{low}_over_full_fwd": ratio(("ropelab", low), ("ropelab", 1.0), part=0),
        "hf_llama_over_ropelab_full": ratio(("hf_llama", 1.0), ("ropelab", 1.0)),
        "ropelab_ref_over_ropelab_at_0.25": ratio(("ropelab_ref", 0.25), ("ropelab", 0.25)),
        "ropelab_torch_over_ropelab_at_0.25": ratio(("ropelab_torch", 0.25), ("ropelab", 0.25)),
        "hf_neox_over_ropelab_torch_at_0.25": ratio(("hf_neox", 0.25), ("ropelab_torch", 0.25)),
    }
    for r in args.keep_pairs:
        ratios[f"plan_shared_{r}_over_full"] = ratio(("plan_shared", r), ("ropelab", 1.0))
        ratios[f"plan_per_head_{r}_over_full"] = ratio(("plan_per_head", r), ("ropelab", 1.0))
        ratios[f"plan_per_head_{r}_over_shared"] = ratio(("plan_per_head", r), ("plan_shared", r))
        ratios[f"plan_per_head_{r}_over_shared_torch"] = ratio(("plan_per_head", r), ("plan_shared_torch", r))
    def fmt(value: float, unit: str = "x") -> str:
        return "n/a" if math.isnan(value) else f"{value:.2f}{unit}"

    print("ratios (fwd+bwd unless named):")
    if args.layout != "half":
        print("  (HF's functions rotate the half layout only: no HF figures for this layout)")
    print(f"  HF partial(0.25) / ropelab(0.25)   {fmt(ratios['hf_neox_over_ropelab_at_0.25'])}   target >= 2")
    print(f"  ropelab full / copy                {fmt(ratios['ropelab_full_over_copy'])}   target <= 1.5"
          f"   (forward alone: {fmt(ratios['ropelab_full_fwd_over_copy'])}; fwd+bwd / two copies: "
          f"{fmt(ratios['ropelab_full_over_two_copies'])})")
    print(f"    memory floor: touch full / copy  {fmt(ratios['touch_full_over_copy'])}   per direction"
          f"   (ropelab full forward / touch full: {fmt(ratios['ropelab_full_fwd_over_touch_full'])})")
    print(f"  ropelab time({low}) / time(1.0)     {fmt(ratios[f'ropelab_{low}_over_full'], '')}    target <= 0.3"
          f"   (forward alone: {fmt(ratios[f'ropelab_{low}_over_full_fwd'], '')})")
    print(f"    memory floor: touch({low}) / touch(1.0)  {fmt(ratios[f'touch_{low}_over_full'], '')}")
    print(f"  HF Llama full / ropelab full       {fmt(ratios['hf_llama_over_ropelab_full'])}")
    print(f"  ropelab reference / fast at 0.25   {fmt(ratios['ropelab_ref_over_ropelab_at_0.25'])}")
    print(f"  ropelab torch path / C at 0.25     {fmt(ratios['ropelab_torch_over_ropelab_at_0.25'])}"
          f"   (HF partial / torch path: {fmt(ratios['hf_neox_over_ropelab_torch_at_0.25'])})")
    if args.keep_pairs:
        print(f"  plans keeping r of {n_pairs} pairs per KV head, time / ropelab full (shared: one table, C kernel;"
              " per-head: no table, eager):")
        print(f"    {'r':>3} {'shared':>8} {'per-head':>9} {'per-head / shared':>18} "
              f"{'per-head / shared torch path':>29}")
        for r in args.keep_pairs:
            print(f"    {r:>3} {fmt(ratios[f'plan_shared_{r}_over_full'], ''):>8} "
                  f"{fmt(ratios[f'plan_per_head_{r}_over_full'], ''):>9} "
                  f"{fmt(ratios[f'plan_per_head_{r}_over_shared']):>18} "
                  f"{fmt(ratios[f'plan_per_head_{r}_over_shared_torch']):>29}")
    record = {
        "benchmark": "rope", "shape_q": [B, H, T, D], "shape_k": [B, K, T, D], "dtype": args.dtype,
        "layout": args.layout, "threads": torch.get_num_threads(), "reps": args.reps, "torch": torch.__version__,
        "cpu_kernel": rope_cpu.available(),
        "machine": platform.processor() or platform.machine(),
        "ms": {f"{name}@{fraction}" if fraction is not None else name: {"fwd": round(f, 4), "fwd_bwd": round(t, 4)}
               for (name, fraction), (f, t) in ms.items()},
        "ratios": {key: None if math.isnan(value) else round(value, 4) for key, value in ratios.items()},
        "plans": {f"{name}@{r}": {"per_head": rope.per_head, "table_bytes": rope.table_bytes(T)}
                  for (name, r), rope in plans.items()},
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
