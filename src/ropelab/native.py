"""C loops compiled on this machine: the build and load shared by ropelab's CPU kernels
(`ropelab.rope.cpu_kernel`, `ropelab.layer_kernels`).

A kernel's C source is compiled once per machine with the system C compiler (``$CC``, else ``cc``
or ``gcc``) into ``$ROPELAB_CACHE/kernels`` (default ``~/.cache/ropelab/kernels``), named by a hash
of the source, the flags and the CPU model (``-march=native`` code must not travel to another
CPU), and loaded with ctypes. Floating point is compiled without fused multiply-adds
(``-ffp-contract=off``), so a loop gives the bits its C expressions say. Parallel loops use
OpenMP; torch has already loaded its own libgomp, so a library binds to torch's thread pool
instead of starting a second one (a compiler without OpenMP builds single-threaded loops).
``ROPELAB_CPU_KERNEL=0`` switches every kernel off: the callers then run their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

# What every kernel's source starts with: the headers, and float32 / bfloat16 elements of a buffer
# as floats (bf16 widened exactly; stored rounded to nearest even, as torch rounds).
PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float load(const void *p, int64_t i, const int bf16) {
  if (!bf16) return ((const float *)p)[i];
  uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x400000u;  /* NaN stays a (quiet) NaN */
  else u += 0x7fffu + ((u >> 16) & 1u);                   /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static inline void store(void *p, int64_t i, float f, const int bf16) {
  if (!bf16) ((float *)p)[i] = f;
  else ((uint16_t *)p)[i] = bf16_bits(f);
}

/* f rounded to bf16 (when bf16) and widened back: the value torch holds after a cast to bf16 */
static inline float rounded(float f, const int bf16) {
  if (!bf16) return f;
  uint32_t u = (uint32_t)bf16_bits(f) << 16;
  memcpy(&f, &u, 4);
  return f;
}
"""
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]
OPENMP = ["-fopenmp"]  # left out, single-threaded, where the compiler has no OpenMP (Apple's clang)


def cpu_model() -> str:
    """The CPU's name and instruction-set flags (a VM's "AMD EPYC" alone does not tell Zen 3 from
    Zen 4, whose -march=native code would not run on Zen 3)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(line for line in first.splitlines() if line.startswith(("model name", "flags")))


def compile_library(compiler: str, source: str, name: str) -> Path:
    """Compile C `source` with `FLAGS` into the kernel cache (once per source, flags and CPU);
    returns the shared library's path (benchmarks build their reference loops with it too)."""
    cache = Path(os.environ.get("ROPELAB_CACHE", Path.home() / ".cache" / "ropelab")) / "kernels"
    key = hashlib.sha256("\0".join([source, *FLAGS, compiler, cpu_model()]).encode()).hexdigest()[:16]
    library = cache / f"{name}-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as work:
        source_file, built = Path(work) / f"{name}.c", Path(work) / f"{name}.so"
        source_file.write_text(source)
        command = [compiler, *FLAGS, str(source_file), "-o", str(built)]
        try:
            subprocess.run(command[:1] + OPENMP + command[1:], check=True, capture_output=True, timeout=300)
        except subprocess.CalledProcessError:
            subprocess.run(command, check=True, capture_output=True, timeout=300)
        os.replace(built, library)  # another process may have built the same file meanwhile: same bytes
    return library


def c_compiler() -> Optional[str]:
    """The system C compiler: ``$CC``, else ``cc`` or ``gcc`` on the PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load(source: str, name: str, what: str) -> Optional[ctypes.CDLL]:
    """The compiled `source`, or None: switched off (``ROPELAB_CPU_KERNEL=0``), no compiler, or the
    build failed (a warning naming `what` says why; its callers fall back to torch)."""
    if os.environ.get("ROPELAB_CPU_KERNEL", "1") == "0":
        return None
    compiler = c_compiler()
    if compiler is None:
        return None
    try:
        return ctypes.CDLL(str(compile_library(compiler, source, name)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(f"ropelab: {what} unavailable, using the torch path ({error} {detail.decode()[:300]})")
        return None
