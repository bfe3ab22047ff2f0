"""glibc's malloc set up for tensor-sized buffers: freed memory is kept and reused, not handed back.

PyTorch's CPU tensors come from malloc. glibc serves a request above its mmap threshold (128 KiB at
first, raised as large blocks are freed, to 32 MiB at most) with a fresh mapping that goes back to
the kernel on free, and it returns the free top of its heap to the kernel beyond the trim
threshold. The next tensor of that size is then paged in again, one zero-filled page fault at a
time. A training step frees and allocates its activations every layer, so its elementwise ops
spend most of their time in those faults: on SmolLM2-135M at 4 x 512 tokens (AMD EPYC, AVX2, 2
threads) the SwiGLU multiplies took 334 ms per 6 layers, and 62 ms with freed buffers kept
(BENCHMARKS.md, "Real model", for the whole step).

`reuse_freed_memory()` fixes the mmap threshold at glibc's largest, 32 MiB, from the start, and
keeps up to 1 GiB of free heap top, so freed buffers stay in the process and serve the next
allocations. Blocks above 32 MiB (an embedding-sized gradient, a loss chunk's logits) are still
mapped and returned on free, so they do not fragment the heap. With them on the heap too (a 1 GiB
mmap threshold) one comparison gave a step of 24.3 s and a peak of 2,296 MiB, against 23.7 s and
2,224 MiB at 32 MiB: no gain, within run-to-run noise. The price is that the process
does not shrink after a peak: its resident memory stays near the largest it has needed, which a
training process reaches again every step anyway.
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
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own largest: blocks up to 32 MiB come from the heap from the start
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
    """Raise glibc's mmap and trim thresholds for this process (module docstring); True if they were set."""
    if why_not_reuse() is not None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


__all__ = ["reuse_freed_memory", "why_not_reuse"]
