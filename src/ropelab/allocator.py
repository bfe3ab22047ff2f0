"""glibc's malloc set up for tensor-sized buffers: freed memory is kept and reused, not handed back.

PyTorch's CPU tensors come from malloc. glibc serves a request above its mmap threshold (128 KiB at
first, raised as large blocks are freed, to 32 MiB at most) with a fresh mapping that goes back to
the kernel on free, and it returns the free top of its heap to the kernel beyond the trim
threshold. The next tensor of that size is then paged in again, one zero-filled page fault at a
time. A training step frees and allocates its activations every layer, so its elementwise ops
spend most of their time in those faults: on SmolLM2-135M at 4 x 512 tokens (AMD EPYC, AVX2, 2
threads) the SwiGLU multiplies took 334 ms per 6 layers, and 62 ms with freed buffers kept
(BENCHMARKS.md, "Real model", for the whole step).

`reuse_freed_memory()` turns glibc's mmap off (every block comes from the heap) and keeps up to 1
GiB of free heap top, so freed buffers stay in the process and serve the next allocations. That
includes the blocks above 32 MiB, glibc's largest threshold, which a step makes anew every time (the
head's bf16 cast, its fp32 gradient, the tied embedding's gradient): mapped, each would be paged in
again. Profiles of a bf16 SmolLM2-135M step at 4 x 512 tokens (AMD EPYC Zen 4, 2 threads, four
pairs) gave, with those on the heap instead of mapped, 0.050-0.052 s instead of 0.086-0.090 s for
the SwiGLU forward loops, 0.027-0.029 s instead of 0.060-0.069 s for the residual adds, and
0.87-1.00 s instead of 0.90-1.14 s outside the matrix products and attention; an fp32 step peaked 13
MiB higher (3,091 against 3,078 MiB added; BENCHMARKS.md). The price is that the process does not
shrink after a peak: its resident memory stays near the largest it has needed, which a training
process reaches again every step anyway.
`train()` calls it on CPU runs (`train.reuse_freed_memory`, on by default).

It changes nothing where the user has chosen an allocator or its settings (`LD_PRELOAD` of
another malloc, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES` with
`glibc.malloc.`), and nothing outside Linux with glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
MMAP_MAX = 0  # no block is mapped: all come from the heap, and freed ones stay there for the next
TRIM_THRESHOLD_BYTES = 1 << 30  # up to 1 GiB of free heap top is kept
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def why_not_reuse(environ: dict | None = None) -> str | None:
    """Why `reuse_freed_memory` would leave malloc as it is here; None where it would set it."""
    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    preload = environ.get("LD_PRELOAD", "")
    chosen = [name for name in OTHER_ALLOCATORS if name in preload]
    if chosen:
        return f"LD_PRELOAD brings {chosen[0]}"
    settings = [name for name in USER_SETTINGS if name in environ]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        settings.append("GLIBC_TUNABLES")
    if settings:
        return f"malloc is set by the environment ({', '.join(settings)})"
    return None


def reuse_freed_memory() -> bool:
    """Turn glibc's mmap off and raise its trim threshold for this process (module docstring); True if set."""
    if why_not_reuse() is not None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, MMAP_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


__all__ = ["reuse_freed_memory", "why_not_reuse"]
