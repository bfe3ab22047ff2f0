"""The machine a figure was measured on: CPU model, the SIMD flags that decide CPU speed-ups, and
what torch makes of them (every benchmark and report records it beside its numbers)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ropelab.precision import cpu_has_native_bf16

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_kind() -> dict:
    """Model name, the SIMD flags that matter here, and what torch makes of them."""
    model, flags = "unknown", set()
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        for line in first.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    try:
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        mkldnn_bf16 = False
    return {"model_name": model,
            "flags": {flag: flag in flags for flag in FLAGS},
            "native_bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn_bf16": mkldnn_bf16, "cpu_has_native_bf16": cpu_has_native_bf16(),
            "nproc": os.cpu_count()}


def describe() -> str:
    """One line: ``AMD EPYC 7B13, 2 threads, AVX2, no AVX-512, no native bf16, torch 2.13.0+cpu``."""
    kind = cpu_kind()
    simd = "AVX-512" if kind["flags"]["avx512f"] else "AVX2" if kind["flags"]["avx2"] else "no AVX2"
    bf16 = "native bf16" if kind["native_bf16"] else "no native bf16"
    return f"{kind['model_name']}, {kind['nproc']} threads, {simd}, {bf16}, torch {torch.__version__}"
