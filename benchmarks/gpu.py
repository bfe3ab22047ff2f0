"""GPU benchmark: the RoPE kernel's bandwidth and the MFU of a 1B training step, on one CUDA device.

    python benchmarks/gpu.py              # about 3-5 minutes on an H100/H200; exits 0 without CUDA
    python benchmarks/gpu.py --dry-run    # the same code on CPU with tiny shapes (what the tests run)

1. rope: `rope.triton_kernel.rotate_qk_` (forward direction; backward is the same kernel at -angle) on q and
   k shaped like the llama-3.2-1b preset's attention (batch x 32 x 2048 x 64 and batch x 8 x 2048 x 64,
   bf16), angles from the cos/sin table or from the frequencies (cache none). Achieved bandwidth =
   bytes the kernel must move (read + write of the rotary channels of q and k) / median time, as a
   share of the datasheet bandwidth. A plain copy of q and k gives the share a copy reaches.
   Target: >= 70% at fraction 1.0.
2. train: one step (forward with loss, backward, fused AdamW, zero_grad) of the llama-3.2-1b preset
   at 2048 tokens per sequence, bf16 autocast, torch.compile; tokens/s from the median step and MFU
   from `ropelab.train.throughput.Throughput` (6N + attention FLOPs over the datasheet bf16 peak).
   Target: >= 40% on an H100/H200-class GPU.
Prints a table, then ONE JSON line with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from ropelab.config import MODEL_PRESETS, TrainConfig
from ropelab.model import Transformer
from ropelab.config import resolve_rotary_dims
from ropelab.rope import inverse_frequencies, rope_angles, rotate_qk_, triton_kernels
from ropelab.train.optim import build_optimizer
from ropelab.train.throughput import Throughput, peak_bandwidth


def median_seconds(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median wall time of fn() over `reps` runs (CUDA: measured with events around each run)."""
    times = []
    for rep in range(warmup + reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
        if rep >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def rotation(q, k, rotary_dims: int, cache: str, positions: torch.Tensor):
    """One in-place rotation of q and k by the kernel `RotaryEmbedding` uses on this device, with the
    angles prepared outside (so the timer holds the kernel alone, not the table bookkeeping)."""
    inv_freq = inverse_frequencies(rotary_dims, q.shape[-1], 500_000.0)
    triton = triton_kernels()
    if triton is None:  # CPU (dry run): cos/sin per token, the C kernel or the torch path
        cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inv_freq))
        return lambda: rotate_qk_(q, k, cos, sin, rotary_dims)
    if cache == "none":
        angles = {"inv_freq": inv_freq.to(q.device)}
    else:
        cos_table, sin_table = rope_angles(torch.arange(q.shape[2], device=q.device), inv_freq)
        angles = {"cos_table": cos_table, "sin_table": sin_table}
    return lambda: triton.rotate_qk_(q, k, rotary_dims=rotary_dims, positions=positions, **angles)


def rope_bandwidth(device, batch, heads, kv_heads, seq, head_dim, fractions, reps, calls) -> dict:
    """Achieved bandwidth of the in-place rotation (and of a copy) per fraction and cache policy.
    Each timed run makes `calls` calls, so launch latency does not hide in the kernel's time."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=gen).to(device, torch.bfloat16)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    peak, peak_source = peak_bandwidth(device)
    q_copy, k_copy = torch.empty_like(q), torch.empty_like(k)

    def copy():
        q_copy.copy_(q)
        k_copy.copy_(k)

    def row(fn, moved: int, **extra) -> dict:
        seconds = median_seconds(lambda: [fn() for _ in range(calls)], device, reps, warmup=2) / calls
        rate = moved / seconds
        return {**extra, "ms": seconds * 1e3, "bytes_per_s": rate, "share": None if peak is None else rate / peak}

    rows = q[..., 0].numel() + k[..., 0].numel()
    figures = {"peak_bytes_per_s": peak, "peak_source": peak_source,
               "copy": row(copy, 2 * rows * head_dim * q.element_size())}
    for fraction in fractions:
        r = resolve_rotary_dims(head_dim, fraction)
        for cache in ("table", "none"):
            figures[f"{cache}@{fraction:g}"] = row(rotation(q, k, r, cache, positions), 2 * rows * r * q.element_size(),
                                                   rotary_dims=r)
    return figures


def train_mfu(device, preset, batch, seq, steps, compile_model) -> dict:
    """tokens/s and MFU of a bf16-autocast training step of `preset` (fused AdamW where supported)."""
    torch.manual_seed(0)
    config = MODEL_PRESETS[preset]
    config = dataclasses.replace(config, vocab_size=config.vocab_size or 4096, max_seq_len=max(seq, config.max_seq_len))
    model = Transformer(config).to(device).train()
    optimizer = build_optimizer(model, TrainConfig())
    forward = torch.compile(model) if compile_model else model
    idx = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    inputs, targets = idx[:, :-1], idx[:, 1:]
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with amp:
            _, loss = forward(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warmup = 3 if compile_model else 1
    seconds = median_seconds(step, device, steps, warmup)
    tracker = Throughput(model, seq, batch * seq, device, torch.bfloat16, window=1)
    figures = tracker.update(seconds)
    return {"preset": preset, "params": model.num_params(), "batch": batch, "seq": seq, "compile": compile_model,
            "fused_adamw": bool(optimizer.defaults.get("fused")), "step_s": seconds, "peak_flops": tracker.peak,
            "peak_source": tracker.peak_source, **figures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU with tiny shapes, no compile")
    parser.add_argument("--rope-batch", type=int, default=16)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 1.0])
    parser.add_argument("--rope-reps", type=int, default=30)
    parser.add_argument("--rope-calls", type=int, default=10, help="kernel calls per timed run")
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        rope_shape = dict(batch=1, heads=4, kv_heads=2, seq=64, head_dim=64)
        args.preset, args.batch, args.seq, args.steps, args.no_compile = "tiny-llama", 1, 32, 2, True
        args.rope_reps, args.rope_calls = 3, 2
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing to measure (use --dry-run to check the script on CPU)")
        return 0
    else:
        device = torch.device("cuda")
        rope_shape = dict(batch=args.rope_batch, heads=32, kv_heads=8, seq=2048, head_dim=64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    rope = rope_bandwidth(device, **rope_shape, fractions=args.fractions, reps=args.rope_reps, calls=args.rope_calls)
    print(f"{name}; rope: {rope_shape}, bf16, in place, median of {args.rope_reps} x {args.rope_calls} calls; "
          f"peak: {rope['peak_source']}")
    print(f"{'case':<12} {'dims':>5} {'ms':>9} {'GB/s':>9} {'share':>7}")
    for key, row in rope.items():
        if isinstance(row, dict):
            share = "-" if row["share"] is None else f"{row['share']:.0%}"
            print(f"{key:<12} {row.get('rotary_dims', '-'):>5} {row['ms']:9.4f} {row['bytes_per_s'] / 1e9:9.1f} {share:>7}")
    train = train_mfu(device, args.preset, args.batch, args.seq, args.steps, not args.no_compile)
    mfu = "-" if train["mfu"] is None else f"{train['mfu']:.1%}"
    print(f"train {train['preset']} ({train['params'] / 1e9:.2f}B params), {train['batch']} x {train['seq']} tokens, "
          f"bf16 autocast, compile {train['compile']}, fused AdamW {train['fused_adamw']}: "
          f"{train['step_s']:.3f} s/step, {train['tokens_per_s']:,.0f} tokens/s, MFU {mfu} ({train['peak_source']})")
    print(json.dumps({"benchmark": "gpu", "device": name, "torch": torch.__version__, "dry_run": args.dry_run,
                      "rope": rope, "train": train}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
