"""Training throughput: tokens per second and model FLOPs utilisation (MFU).

MFU is the model's training FLOPs per second over the device's peak FLOP/s (Chowdhery et al.
2022, PaLM, appendix B). The model's FLOPs per token come from `Transformer.flops_per_token`
(6N plus the attention term). The peak is:
  * on NVIDIA GPUs: the dense (no sparsity) bf16 tensor-core figure of the card's datasheet,
    matched by the name torch reports (`GPU_SPECS`, which also lists the memory bandwidth that
    `benchmarks/gpu.py` compares its RoPE kernel with). An unknown card has no peak, so no MFU;
  * on CPUs: measured. No datasheet speaks for a virtual machine's share of a CPU, and the vector
    units decide which dtype is fast (on AVX2-only CPUs bfloat16 matrix products are slower than
    float32). The figure is the best of a few timed square matrix products in the dtype the
    training runs, on torch's threads, measured once per process (`measured_cpu_peak`), or once
    per study: `ropelab study` measures it for its trainers and hands it to them in `PEAKS_ENV`
    (a timed product costs about 0.4 s of every trainer's start-up; a run of a tiny size trains 1-3 s).

A measured peak is only as good as the moment it was measured: other work on the machine slows the
timed products down, and steps run once it has gone then beat the "peak" (MFU above 100%). So a
step faster than the measured peak makes `Throughput` measure it again, once; should the step still
be faster, its own rate becomes the peak (the least the machine is known to reach), so that MFU
never exceeds 1 and `peak_source` says so. A datasheet peak is never changed.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class GpuSpec:
    pattern: str  # regular expression searched in torch.cuda.get_device_name()
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s
    bandwidth: float  # memory bandwidth, bytes/s


# NVIDIA datasheets (Ada/Ampere architecture whitepapers for the GeForce cards). Datasheets quote
# bf16 "with sparsity"; these are the dense figures, half of those. First match wins.
GPU_SPECS = (
    GpuSpec(r"H100.*PCIe", 756e12, 2.0e12),
    GpuSpec(r"H100.*NVL", 835e12, 3.9e12),
    GpuSpec(r"H100", 989e12, 3.35e12),  # SXM
    GpuSpec(r"(?<!G)H200.*NVL", 835e12, 4.8e12),
    GpuSpec(r"(?<!G)H200", 989e12, 4.8e12),  # SXM
    GpuSpec(r"A100.*80GB.*PCIe", 312e12, 1.935e12),
    GpuSpec(r"A100.*80GB", 312e12, 2.039e12),  # SXM
    GpuSpec(r"A100", 312e12, 1.555e12),  # 40GB
    GpuSpec(r"\bL40S\b", 362e12, 864e9),
    GpuSpec(r"\bL40\b", 181e12, 864e9),
    GpuSpec(r"\bL4\b", 121e12, 300e9),
    GpuSpec(r"\bA10\b", 125e12, 600e9),
    GpuSpec(r"RTX 4090", 165e12, 1.008e12),
    GpuSpec(r"RTX 3090", 71e12, 936e9),
)


def gpu_spec(name: str) -> Optional[GpuSpec]:
    """The datasheet row for a GPU name as torch reports it (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    return next((spec for spec in GPU_SPECS if re.search(spec.pattern, name)), None)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


PEAKS_ENV = "ROPELAB_CPU_PEAKS"  # "float32/1=3.8e+11,bfloat16/2=...": FLOP/s per dtype and thread count


def peaks_environment(peaks: dict[tuple[torch.dtype, int], float]) -> dict[str, str]:
    """`PEAKS_ENV` holding `peaks` ({(dtype, threads): FLOP/s}), for a trainer's environment."""
    return {PEAKS_ENV: ",".join(f"{str(dtype).removeprefix('torch.')}/{threads}={flops!r}"
                                for (dtype, threads), flops in peaks.items())}


def given_cpu_peak(dtype: torch.dtype, threads: int) -> Optional[float]:
    """The peak `PEAKS_ENV` gives for `dtype` on `threads`; None where it gives none or no positive number."""
    wanted = f"{str(dtype).removeprefix('torch.')}/{threads}"
    for entry in os.environ.get(PEAKS_ENV, "").split(","):
        key, _, value = entry.partition("=")
        if key.strip() == wanted:
            try:
                flops = float(value)
            except ValueError:
                return None
            return flops if math.isfinite(flops) and flops > 0 else None
    return None


@functools.cache
def measured_cpu_peak(dtype: torch.dtype = torch.float32, threads: Optional[int] = None) -> float:
    """`measure_cpu_peak`, once per process and arguments, unless the environment gives it (`PEAKS_ENV`)."""
    return given_cpu_peak(dtype, threads or torch.get_num_threads()) or measure_cpu_peak(dtype, threads)


def measure_cpu_peak(dtype: torch.dtype = torch.float32, threads: Optional[int] = None) -> float:
    """FLOP/s of the fastest square matrix products in `dtype` on `threads` (default: torch's).

    Each size is tried in the three operand layouts a training step meets (a @ b, a @ b.T and
    a.T @ b: forward and the two backward products), and the fastest counts: without bf16 units,
    torch's bfloat16 fallback runs them at speeds 10-25x apart. The size doubles from 128 until a
    product takes 10 ms (or reaches 2048), so a slow dtype is not timed on matrices that would
    take seconds."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        size = 64
        while True:
            size *= 2
            a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
            layouts = (lambda: torch.mm(a, b), lambda: torch.mm(a, b.t()), lambda: torch.mm(a.t(), b))
            for product in layouts:
                product()  # warm-up: allocations, thread pool, kernel choice
            fastest = min(layouts, key=lambda product: min(_seconds(product) for _ in range(2)))
            if min(_seconds(fastest) for _ in range(2)) > 0.01 or size >= 2048:
                break
        times = [_seconds(fastest) for _ in range(3)]
        while sum(times) < 0.3 and len(times) < 20:
            times.append(_seconds(fastest))
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / min(times)


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> tuple[Optional[float], str]:
    """(peak FLOP/s, where the figure comes from) of `device` for training in `dtype`; None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = gpu_spec(name)
        if spec is None:
            return None, f"no datasheet peak known for {name!r}: MFU not reported"
        return spec.bf16_flops, f"NVIDIA datasheet, {name}, bf16 dense"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        dtype_name = str(dtype).removeprefix("torch.")
        by = ", once for the study" if given_cpu_peak(dtype, threads) else ""
        return measured_cpu_peak(dtype, threads), f"measured {dtype_name} matmul, {threads} threads{by}"
    return None, f"no peak known for device type {device.type!r}: MFU not reported"


def peak_bandwidth(device: torch.device | str) -> tuple[Optional[float], str]:
    """(memory bandwidth in bytes/s, source) of a CUDA device from `GPU_SPECS`; None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no bandwidth table for device type {device.type!r}"
    name = torch.cuda.get_device_name(device)
    spec = gpu_spec(name)
    if spec is None:
        return None, f"no datasheet bandwidth known for {name!r}"
    return spec.bandwidth, f"NVIDIA datasheet, {name}"


RAISED = ", raised to a step's rate (the timed products ran under other load)"


class Throughput:
    """Tokens/s over the last `window` steps, and MFU of `model` at `seq_len` tokens per sequence.

    `peak` overrides the device's peak FLOP/s (default: `peak_flops(device, dtype)`, where dtype is
    the precision the matrix products run in: bfloat16 under bf16 autocast)."""

    def __init__(
        self, model: torch.nn.Module, seq_len: int, tokens_per_step: int, device: torch.device | str,
        dtype: torch.dtype = torch.float32, window: int = 20, peak: Optional[float] = None,
    ):
        self.model, self.seq_len, self.tokens_per_step, self.dtype = model, seq_len, tokens_per_step, dtype
        self.peak, self.peak_source = (peak, "given") if peak is not None else peak_flops(device, dtype)
        self.step_seconds: deque[float] = deque(maxlen=window)
        self.measured = peak is None and torch.device(device).type == "cpu"  # may be measured again
        self.remeasured = False

    def update(self, step_seconds: float) -> dict[str, Optional[float]]:
        """Record one step's wall time; returns {"tokens_per_s", "mfu"} over the window (mfu None
        when the peak is unknown)."""
        self.step_seconds.append(step_seconds)
        tokens_per_s = self.tokens_per_step * len(self.step_seconds) / sum(self.step_seconds)
        mfu = self.model.mfu(tokens_per_s, self.seq_len, self.peak) if self.peak else None
        if mfu is not None and mfu > 1 and self.measured:
            mfu = self._beyond_measured_peak(tokens_per_s)
        return {"tokens_per_s": tokens_per_s, "mfu": mfu}

    def _beyond_measured_peak(self, tokens_per_s: float) -> float:
        """MFU of a step faster than the measured CPU peak, after measuring it again (once per tracker),
        and raising it to the step's rate if that is still faster (see the module docstring)."""
        if not self.remeasured:
            self.remeasured = True
            self.peak = max(self.peak, measure_cpu_peak(self.dtype, torch.get_num_threads()))
        achieved = self.model.flops_per_token(self.seq_len) * tokens_per_s
        if achieved > self.peak:
            self.peak = achieved
            if RAISED not in self.peak_source:
                self.peak_source += RAISED
        return achieved / self.peak
