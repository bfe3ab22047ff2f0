"""C loops compiled on this machine: the build and load shared by ropelab's CPU kernels
(`ropelab.rope.cpu_kernel`, `ropelab.layer_kernels`).

A kernel's C source is compiled once per machine with the system C compiler (``$CC``, else ``cc``
or ``gcc``) into ``$ROPELAB_CACHE/kernels`` (default ``~/.cache/ropelab/kernels``), named by a hash
of the source, the flags and the CPU model (``-march=native`` code must not travel to another
CPU), and loaded with ctypes. Floating point is compiled without implicit fused multiply-adds
(``-ffp-contract=off``; `exp_of` writes its own), so a loop gives the bits its C expressions say.
Parallel loops use OpenMP; torch has already loaded its own libgomp, so a library binds to torch's
thread pool instead of starting a second one (a compiler without OpenMP builds single-threaded loops).
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

import torch

# What every kernel's source starts with: the headers; float32 / bfloat16 elements of a buffer as
# floats (bf16 widened exactly; stored rounded to nearest even, as torch rounds); a vectorisable exp;
# and the split of a parallel loop over torch's threads.
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

/* exp(x) to within 2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 7
   (truncation below 1e-8 relative), times 2^n built from n's bits. Inputs above 88.7228 give inf
   and below -86.5 give 0 (where exp(x) < 2.7e-38): every caller adds it to 1 or more. Those two
   come from the scale's bits (0 and inf times the positive polynomial), not from a select of
   constants: GCC would carry a constant result into each caller's division and vectorise that
   division once per case. */
static inline float exp_of(const float x) {
  const float top = 88.72283935546875f, bottom = -86.5f;
  const float c = x < bottom ? bottom : (x > top ? top : x);
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
  /* fused multiply-adds (one rounding each, half the instructions: the loops that call this are
     bound by their instruction count); a CPU without FMA gets libm's fmaf, the same bits */
  float r = __builtin_fmaf(n, -0.693359375f, c);  /* ln2 in two parts: n * the first is exact */
  r = __builtin_fmaf(n, 2.12194440e-4f, r);
  float p = 1.0f / 5040.0f;
  p = __builtin_fmaf(p, r, 1.0f / 720.0f);
  p = __builtin_fmaf(p, r, 1.0f / 120.0f);
  p = __builtin_fmaf(p, r, 1.0f / 24.0f);
  p = __builtin_fmaf(p, r, 1.0f / 6.0f);
  p = __builtin_fmaf(p, r, 0.5f);
  p = __builtin_fmaf(p, r, 1.0f);
  p = __builtin_fmaf(p, r, 1.0f);
  uint32_t bits = (uint32_t)((int32_t)n + 126) << 23;  /* 2^(n-1): n - 1 >= -126 stays normal */
  bits = x < bottom ? 0u : (x > top ? 0x7f800000u : bits);  /* 0, inf */
  float half_scale;
  memcpy(&half_scale, &bits, 4);
  return p * half_scale * 2.0f;
}

/* Threads for `work` elements: each at least 32768, as torch's own parallel loops (at::internal::GRAIN_SIZE). */
static inline int team(int64_t threads, const int64_t work) {
  const int64_t most = work / 32768;
  if (threads > most) threads = most > 1 ? most : 1;
  return (int)threads;
}

#ifdef _OPENMP
#define SPAN(n, lo, hi) const int64_t id_ = omp_get_thread_num(), parts_ = omp_get_num_threads(), \
  lo = (n) * id_ / parts_, hi = (n) * (id_ + 1) / parts_
#define THREAD_ID omp_get_thread_num()
#else
#define SPAN(n, lo, hi) const int64_t lo = 0, hi = (n)
#define THREAD_ID 0
#endif
"""
# the dtype flag the loops take for a tensor (their load/store read bf16 where it is 1)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
I64, F32, ADDRESS = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p  # the loops' argument types
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


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether the loops can take `tensors`: contiguous float32/bfloat16 CPU tensors, and not while
    torch.compile traces (a C call would break its graph)."""
    if torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" and t.dtype in DTYPES and t.is_contiguous() for t in tensors)


def load(source: str, name: str, what: str, signatures: dict[str, list]) -> Optional[ctypes.CDLL]:
    """The compiled `source` with each function of `signatures` given its ctypes argument types (all
    return void), or None: switched off (``ROPELAB_CPU_KERNEL=0``), no compiler, or the build failed
    (a warning naming `what` says why; its callers fall back to torch)."""
    if os.environ.get("ROPELAB_CPU_KERNEL", "1") == "0":
        return None
    compiler = c_compiler()
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(compile_library(compiler, source, name)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(f"ropelab: {what} unavailable, using the torch path ({error} {detail.decode()[:300]})")
        return None
    for function, argtypes in signatures.items():
        getattr(lib, function).restype = None
        getattr(lib, function).argtypes = argtypes
    return lib
