"""SmolLM2-135M, ropelab `Transformer` against Hugging Face's `LlamaForCausalLM`: speed and peak memory.

    python benchmarks/real_model.py                   # every row, --reps 3 (on 2 cores: 26 min at load 1-4,
                                                      # 75 min at load 2.5-9.8)
    python benchmarks/real_model.py --rows train,train-full --reps 5
    python benchmarks/real_model.py --quick           # 2 random layers, tiny lengths (the test), < 1 min

The two models and what each row runs: real_model_rows.py.

Precisions: fp32; bf16 autocast too where the CPU multiplies bf16 natively (/proc/cpuinfo flag
avx512_bf16 or amx_bf16). Elsewhere bf16 is reported as not measured, with the reason: PyTorch's
bf16 kernels there are emulated and many times slower than fp32, so the row would measure the
emulation, not either library.

Speed: both models live in this process and their runs alternate (rotating order, `--warmup`
untimed runs each first), so both meet the same machine load. A row's figure is tokens / median
seconds; the ratio ropelab/HF is the median over repetitions of t_HF / t_ropelab measured in that
repetition, with its min and max.

Peak memory: every (library, row) runs in a fresh subprocess (`--isolate row`; `--quick` uses
`--isolate library`: one per library, its rows in turn), `--memory-jobs` of them at once (a
process's peak is its own). Each loads its model, reads every weight once (so memory-mapped weights
are resident before the row, not during it), frees what loading left (gc, malloc_trim), records its
resident set (VmRSS), resets the kernel's peak-RSS mark (writes 5 to /proc/self/clear_refs), runs
the row (a forward once; a training step twice, the second with the AdamW state the first one
created) and reads the peak mark (VmHWM). The figure is that peak minus the RSS after loading: what
the row adds on top of the weights, optimizer state included. Resetting the mark keeps the loaders'
own transient peaks (GGUF dequantization) out of it. Where clear_refs cannot be written the
subprocess reports getrusage(RUSAGE_SELF).ru_maxrss instead, which includes the load, and says so
(`peak_method`). The HF subprocess builds `LlamaForCausalLM` from the config of the model this
process loaded (`from_config`, same attention implementation) and loads its state dict, saved here
before any training step (transformers' GGUF import takes ~45 s, and a GGUF-loaded model refuses
`save_pretrained`); the ropelab subprocess loads its model as above.

GEMM floor: after its timed runs, each training row runs per library profiled steps whose figures are
dropped (after the other library's runs) until one pages in less than 16 MiB (at most 6: `settle`), then
`--reps` steps in a row under torch.profiler (CPU), as a training loop runs them. A fresh heap grows over
a step's first few calls, and a step that still pages in memory spends up to 0.1 s of a 7 s SmolLM2 step
on page faults that a running training loop no longer meets; each profiled step's paged-in MiB is in the
JSON. In each profiled step the self time of its matrix-product kernels is summed (`GEMM_OPS`: mm,
addmm, bmm, baddbmm, addbmm, their in-place forms, _addmm_activation); linear and matmul are not
counted: they are composites that call those, their own time the reshaping around them. Both libraries
run PyTorch's fused CPU attention (`ATTENTION_OPS`: _scaled_dot_product_flash_attention_for_cpu and its
backward), whose QK^T and PV products sit in one loop with the softmax, so a profile cannot split them.
Each step's wall time over its own products gives two figures: over the GEMM kernels alone
(`gemm_floor`, attention counted as overhead) and over the GEMM kernels plus the attention kernels
(`product_floor`, attention counted as matrix products, its softmax included); a row reports the median
over its profiled steps, and their range. 1.0 would be a step that does nothing but them; AdamW, norms,
activations and the loss are the rest; the profiler's own cost counts against the step. Numerator and
denominator come from the same step: on a shared 2-core VM the speed of the machine drifts by 10-20%
within minutes, so a median of the timed (alternating) runs over one profiled step's products would
mix two moments (it is kept in the JSON as `timed_product_floor`). The targets are checked on both
figures. How much of the attention kernel is products: `benchmarks/attention.py --products`.

Own-process floors: the same profiled steps again in each training row's memory subprocess, after its
peak has been read, with glibc set as for the timed runs (`--malloc`): a process that holds one model
and its optimizer, as a training run does. In this process the other library's model, AdamW state and
freed blocks share the heap, and glibc 2.36 does not reuse a freed block for a 64-byte-aligned request
of the same size, so a profiled step here pages in fresh heap that a training process would not
(BENCHMARKS.md, issue #30). Both are reported (`own_process` in the JSON) and the targets are checked on
both. They are measured one process at a time only with `--memory-jobs 1` (the default outside --quick).
There the profiled steps follow the peak's two steps and the same settling (HF's subprocess keeps
glibc's own settings, which map each block over 32 MiB anew, so its steps never settle and it runs all six).

malloc: by default (`--malloc reuse`) glibc keeps freed buffers for reuse (`ropelab.allocator`, what
ropelab's trainer sets on CPU runs), in this process, so for both libraries' timed runs, and in
ropelab's memory subprocesses (HF's run with glibc's own settings, as a plain HF user's would).
`--malloc default` leaves glibc as it comes everywhere.

Prints a table, the ratios against the targets of issue #15 (every row at least as fast as HF; the
training step at least 1.15x HF's tokens/s with at most 0.6x HF's peak memory) and of issue #30
(ropelab's training steps at most 1.10x their GEMM floor), then ONE JSON line with every figure, the
CPU kind and the load average. benchmarks/train.py has no timing or CPU
helpers to share (it times inline), so this script has its own.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ropelab.allocator import reuse_freed_memory, why_not_reuse
from ropelab.machine import cpu_kind

# this script's folder is on sys.path wherever it runs (python benchmarks/real_model.py, its memory subprocesses)
from real_model_rows import (LIBRARIES, QUICK_LAYERS, ROWS, SMOLLM2_SHAPE, SOURCE, load_hf, load_hf_saved,  # noqa: E402
                             load_ropelab, make_run, save_hf, shape_mismatch, shape_of, token_ids)

RUNS_FOR_PEAK = {"forward": 1, "train": 2}  # the second training step runs with the first one's AdamW state
# ropelab / HF tokens/s, at least; every training row against HF's default training step
SPEED_TARGETS = {"forward2k": 1.0, "forward8k": 1.0, "train": 1.15, "train-mlp": 1.15, "train-full": 1.15}
MEMORY_TARGETS = {"train": 0.6, "train-mlp": 0.6, "train-full": 0.6}  # ropelab / HF peak memory, at most
# ropelab's step over its matrix products' time, at most: GEMM kernels alone (gemm_floor), and with the fused
# attention kernels counted as matrix products too (product_floor)
GEMM_FLOOR_TARGETS = {"train": 1.10, "train-mlp": 1.10, "train-full": 1.10}
FLOORS = ("gemm_floor", "product_floor")
# the profiled steps wait for a step that pages in less than this (`settle`), at most MAX_SETTLING_STEPS
STEADY_PAGED_IN_MIB = 16
MAX_SETTLING_STEPS = 6
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::addbmm",
            "aten::addbmm_", "aten::_addmm_activation")
# PyTorch's fused CPU attention: its work is the QK^T and PV products, with the softmax inside the same loop
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


# ------------------------------------------------------------------ the machine


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------ peak memory (subprocess)


def _status_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise OSError(f"/proc/self/status has no {key}")
    return int(match.group(1))


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_memory(library: str, rows: list[str], quick: bool, precision: str, hf_dir: Optional[str],
                   hf_attn: str, floor_reps: int = 0, reuse: bool = False) -> dict:
    """In this (fresh) process: load the model, then each row's peak RSS (over `RUNS_FOR_PEAK` runs) minus
    the RSS after loading; then, with `floor_reps`, each training row's `floor_profiles` (glibc set to keep
    freed buffers first if `reuse`), as `own_process`."""
    model = load_ropelab(quick) if library == "ropelab" else load_hf_saved(hf_dir, hf_attn)
    with torch.no_grad():  # weights a loader memory-maps become resident now, not inside a row
        for tensor in model.state_dict().values():
            tensor.sum()
    _trim()
    loaded_kib = _status_kib("VmRSS")
    figures = {"loaded_mib": round(loaded_kib / 1024, 1), "loaded_file_mib": round(_status_kib("RssFile") / 1024, 1),
               "rows": {}}
    for name in rows:
        run = make_run(library, model, ROWS[name], quick, precision)
        _trim()
        before_kib = _status_kib("VmRSS")
        reset = _reset_peak()
        for _ in range(RUNS_FOR_PEAK[ROWS[name].kind]):
            run()
        peak_kib = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        figures["rows"][name] = {"peak_mib": round(peak_kib / 1024, 1),
                                 "added_mib": round((peak_kib - loaded_kib) / 1024, 1),
                                 "rss_before_mib": round(before_kib / 1024, 1),
                                 "file_mib_after": round(_status_kib("RssFile") / 1024, 1),
                                 "peak_method": "VmHWM after clear_refs" if reset else "ru_maxrss (includes loading)"}
        del run
        for p in model.parameters():
            p.grad = None
    train_rows = [name for name in rows if ROWS[name].kind == "train"]
    if floor_reps and train_rows:
        if reuse:
            reuse_freed_memory()  # after the peaks: HF's are measured with glibc's own settings
        for name in train_rows:
            floors = floor_profiles(make_run(library, model, ROWS[name], quick, precision), floor_reps)
            figures["rows"][name]["own_process"] = {key: floors[key] for key in (
                *FLOORS, *(f"{which}_range" for which in FLOORS), "gemm_s", "attention_s", "settling_paged_in_mib",
                "floor_steps")}
    return figures


def memory_in_subprocesses(jobs: list[tuple[str, str, list[str]]], args, hf_dir: str, hf_attn: str) -> list[dict]:
    """`measure_memory` of each (library, precision, rows) in a fresh interpreter, `args.memory_jobs` at a
    time: a process's peak RSS is its own, so running several at once changes only the wall time."""
    def start(library: str, precision: str, rows: list[str]) -> subprocess.Popen:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", library, "--rows", ",".join(rows),
               "--precision", precision, "--hf-dir", hf_dir, "--hf-attn", hf_attn, "--malloc", args.malloc,
               "--reps", str(args.reps)]
        if args.quick:
            cmd.append("--quick")
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(proc: subprocess.Popen, job) -> dict:
        stdout, stderr = proc.communicate()
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"memory subprocess {job} failed (exit {proc.returncode}): {stderr.strip()[-2000:]}")
        return json.loads(lines[-1])

    figures = []
    for first in range(0, len(jobs), args.memory_jobs):
        batch = jobs[first:first + args.memory_jobs]
        procs = [start(*job) for job in batch]
        figures += [finish(proc, job) for proc, job in zip(procs, batch)]
        progress(f"memory: {', '.join(f'{library} {precision} {rows}' for library, precision, rows in batch)} done")
    return figures


# ------------------------------------------------------------------ speed (this process)


def time_row(runs: dict[str, Callable], reps: int, warmup: int) -> tuple[dict[str, list[float]], list]:
    """Alternating runs (rotating order) -> (seconds per library, first-run return values)."""
    times = {library: [] for library in runs}
    first = {}
    names = list(runs)
    for i in range(warmup + reps):
        for library in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            value = runs[library]()
            elapsed = time.perf_counter() - t0
            first.setdefault(library, value)
            if i >= warmup:
                times[library].append(elapsed)
    return times, first


def paged_in_mib() -> float:
    """MiB this process has paged in so far (minor page faults: fresh memory touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize() / 2**20


def profiled(run: Callable):
    """One call of `run` under torch.profiler (CPU) -> (its wall seconds, the MiB it paged in, the profile)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        paged, t0 = paged_in_mib(), time.perf_counter()
        run()
        wall, paged = time.perf_counter() - t0, paged_in_mib() - paged
    return wall, round(paged, 1), prof


def gemm_profile(wall: float, prof) -> dict:
    """A profiled call's wall seconds, the self seconds and calls of each op of GEMM_OPS and ATTENTION_OPS
    that it ran, the sum of each group, and the wall over those sums."""
    ops = {e.key: {"calls": e.count, "self_s": e.self_cpu_time_total / 1e6}
           for e in prof.key_averages() if e.key in GEMM_OPS + ATTENTION_OPS}

    def group(names: tuple[str, ...]) -> dict:
        return {key: {**op, "self_s": round(op["self_s"], 6)} for key, op in sorted(ops.items()) if key in names}

    gemm, attention = group(GEMM_OPS), group(ATTENTION_OPS)
    gemm_s, attention_s = (sum(op["self_s"] for op in ops.values()) for ops in (gemm, attention))
    return {"profiled_s": round(wall, 6), "gemm_s": round(gemm_s, 6), "attention_s": round(attention_s, 6),
            "gemm_floor": round(wall / gemm_s, 4) if gemm_s else None,
            "product_floor": round(wall / (gemm_s + attention_s), 4) if gemm_s + attention_s else None,
            "gemm_ops": gemm, "attention_ops": attention}


def settle(run: Callable) -> list[float]:
    """Profiled calls of `run` (their figures dropped) until one pages in less than STEADY_PAGED_IN_MIB, at
    most MAX_SETTLING_STEPS: the MiB each call paged in. A fresh heap grows over a training step's first few
    calls (glibc finds no freed block for some 64-byte-aligned requests until neighbours have merged), and so
    do the profiler's own buffers: a call that pages in hundreds of MiB spends tens of ms on page faults
    that a running training loop no longer meets."""
    paged = []
    while len(paged) < MAX_SETTLING_STEPS:
        paged.append(profiled(run)[1])
        if paged[-1] < STEADY_PAGED_IN_MIB:
            break
    return paged


def floor_profiles(run: Callable, reps: int) -> dict:
    """`settle`, then `reps` profiled calls of `run` in a row (each profile read after the last call, so that
    reading one does not reshape the heap under the next): the figures of the median step (by product_floor),
    the median and range of each floor over the steps, and every step's figures."""
    settling = settle(run)
    calls = [profiled(run) for _ in range(reps)]
    steps = [{**gemm_profile(wall, prof), "paged_in_mib": paged} for wall, paged, prof in calls]
    middle = sorted(steps, key=lambda step: step["product_floor"] or 0.0)[(reps - 1) // 2]
    floors = {}
    for which in FLOORS:
        values = [step[which] for step in steps if step[which] is not None]
        floors[which] = round(statistics.median(values), 4) if values else None
        floors[f"{which}_range"] = [min(values), max(values)] if values else None
    return {**middle, **floors, "settling_paged_in_mib": settling, "floor_steps": [
        {key: step[key] for key in ("profiled_s", "gemm_s", "attention_s", "paged_in_mib")} for step in steps]}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}, load average {loadavg()}", file=sys.stderr, flush=True)


def target(value: float, bound: float, at_least: bool) -> dict:
    met = value >= bound if at_least else value <= bound
    return {"value": value, "target": f"{'>=' if at_least else '<='} {bound:g}", "met": bool(met)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=None, help="timed runs per library and row (median; default 3, "
                        "--quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs per library and row first (default 1, "
                        "--quick 0)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--quick", action="store_true", help="2 random layers of SmolLM2's shape, tiny lengths")
    parser.add_argument("--isolate", choices=["row", "library"], default=None,
                        help="one memory subprocess per (library, row) (default) or per library (--quick's default)")
    parser.add_argument("--precisions", default="auto",
                        help="fp32, bf16 or both comma-separated; auto: fp32, plus bf16 on a CPU with native bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--memory-jobs", type=int, default=None,
                        help="memory subprocesses run at once (default 1, --quick 2); a process's peak is its own")
    parser.add_argument("--malloc", choices=["reuse", "default"], default="reuse",
                        help="reuse (default): glibc keeps freed buffers (ropelab.allocator, as ropelab's trainer "
                        "sets it), in this process for both libraries' timed runs and in ropelab's memory "
                        "subprocesses; default: glibc's own settings everywhere")
    parser.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--hf-attn", default="sdpa", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.memory_jobs = args.memory_jobs if args.memory_jobs is not None else (2 if args.quick else 1)
    if args.memory_jobs < 1:
        parser.error("--memory-jobs must be at least 1")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be at least 1 and --warmup at least 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = [name for name in rows if name not in ROWS]
    if unknown or not rows:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    rows = [name for name in ROWS if name in rows]  # forwards before the training step, which moves the weights

    args.reuse_freed_memory = args.malloc == "reuse" and args.child in (None, "ropelab") and reuse_freed_memory()
    if args.child:
        print(json.dumps(measure_memory(args.child, rows, args.quick, args.precision, args.hf_dir, args.hf_attn,
                                        args.reps, args.malloc == "reuse")))
        return 0

    started = time.perf_counter()
    load_start = loadavg()
    cpu = cpu_kind()
    requested = ["fp32", "bf16"] if args.precisions == "auto" else [p.strip() for p in args.precisions.split(",")]
    precisions, not_measured = [], {}
    for precision in requested:
        if precision == "bf16" and not cpu["native_bf16"]:
            not_measured["bf16"] = ("not measured: this CPU has no native bf16 (no avx512_bf16 / amx_bf16 in "
                                    "/proc/cpuinfo), so PyTorch's bf16 kernels are emulated and several times "
                                    "slower than fp32; a bf16 row would time the emulation, not the libraries")
        elif precision in ("fp32", "bf16"):
            precisions.append(precision)
        else:
            parser.error(f"--precisions: {precision!r}")
    isolate = args.isolate or ("library" if args.quick else "row")

    ours, hf = load_ropelab(args.quick), load_hf(args.quick)
    mismatch = [] if args.quick else shape_mismatch(ours.config)
    check_ids = token_ids(1, 64, ours.config.vocab_size)
    with torch.no_grad():
        logits_diff = (ours(check_ids)[0] - hf(check_ids).logits).abs().max().item()
    hf_attn = hf.config._attn_implementation
    hf_dir = tempfile.mkdtemp(prefix="real_model_hf_")  # what the HF memory subprocesses load
    try:
        save_hf(hf, hf_dir)  # before any training step moves the weights
        models = {"ropelab": ours, "hf": hf}
        del ours, hf  # run_all frees them before the memory subprocesses
        return run_all(args, rows, precisions, not_measured, isolate, cpu, load_start, started, models, hf_dir,
                       hf_attn, mismatch, logits_diff)
    finally:
        shutil.rmtree(hf_dir, ignore_errors=True)


def run_all(args, rows, precisions, not_measured, isolate, cpu, load_start, started, models: dict, hf_dir: str,
            hf_attn: str, mismatch: list, logits_diff: float) -> int:
    ours, hf = models["ropelab"], models["hf"]
    phases = {"load_s": round(time.perf_counter() - started, 1)}
    n_params = ours.num_params()
    print(f"{'quick: ' + str(QUICK_LAYERS) + ' random layers of ' if args.quick else ''}SmolLM2-135M"
          f"{' shape' if args.quick else ''}: {ours.config.n_layer} layers, {n_params / 1e6:.1f}M parameters; "
          f"HF {type(hf).__name__} ({hf_attn}); max |logits difference| on 64 tokens {logits_diff:.2e}")
    if mismatch:
        print(f"warning: the file's shape differs from SMOLLM2_SHAPE: {'; '.join(mismatch)}")
    print(f"CPU: {cpu['model_name']}, flags " + " ".join(f"{k}={'y' if v else 'n'}" for k, v in cpu["flags"].items())
          + f", torch {torch.__version__} ({cpu['torch_cpu_capability']}), {torch.get_num_threads()} threads, "
          f"load average {load_start}")
    print("malloc: " + ("glibc keeps freed buffers (ropelab.allocator), for both libraries' timed runs and ropelab's "
                        "memory subprocesses" if args.reuse_freed_memory
                        else "glibc's own settings (" + ("--malloc default" if args.malloc == "default"
                                                          else why_not_reuse() or "mallopt refused") + ")"))
    for precision, reason in not_measured.items():
        print(f"{precision}: {reason}")

    results, ratios, losses = {}, {}, {}
    # every training row starts from the loaded weights, so that each row's first losses compare the same model
    # (after a dozen steps on one batch the two libraries' weights have drifted apart)
    loaded = {library: {key: t.detach().clone() for key, t in model.state_dict().items()}
              for library, model in models.items()}
    for precision in precisions:
        for name in rows:
            row = ROWS[name]
            batch, seq = shape_of(row, args.quick)
            if row.kind == "train":
                for library, model in models.items():
                    model.load_state_dict(loaded[library])
            runs = {library: make_run(library, model, row, args.quick, precision) for library, model in models.items()}
            times, first = time_row(runs, args.reps, args.warmup)
            floors = {library: floor_profiles(runs[library], args.reps) for library in LIBRARIES
                      } if row.kind == "train" else {}
            del runs
            progress(f"timed {precision} {name}: " + ", ".join(
                f"{library} {statistics.median(times[library]):.2f} s" for library in LIBRARIES))
            for library in LIBRARIES:
                median = statistics.median(times[library])
                results[f"{precision}/{name}/{library}"] = {
                    "batch": batch, "seq": seq, "seconds": [round(t, 4) for t in times[library]],
                    "median_s": round(median, 4), "tokens_per_s": round(batch * seq / median, 1)}
                if library in floors:
                    products = floors[library]["gemm_s"] + floors[library]["attention_s"]
                    results[f"{precision}/{name}/{library}"].update(
                        {**floors[library], "timed_product_floor": round(median / products, 4) if products else None})
            per_rep = [t_hf / t_ours for t_ours, t_hf in zip(times["ropelab"], times["hf"])]
            ratios[f"{precision}/{name}"] = {"speed": round(statistics.median(per_rep), 4),
                                             "speed_min": round(min(per_rep), 4), "speed_max": round(max(per_rep), 4)}
            if row.kind == "train":
                losses[f"{precision}/{name}"] = {library: round(first[library], 5) for library in LIBRARIES}
            for p in list(ours.parameters()) + list(hf.parameters()):
                p.grad = None
            gc.collect()
    del loaded
    load_after_timing = loadavg()
    phases["timing_s"] = round(time.perf_counter() - started - phases["load_s"], 1)

    del ours, hf
    models.clear()
    _trim()
    groups = [[name] for name in rows] if isolate == "row" else [rows]
    jobs = [(library, precision, group) for precision in precisions for library in LIBRARIES for group in groups]
    for (library, precision, _), figures in zip(jobs, memory_in_subprocesses(jobs, args, hf_dir, hf_attn)):
        for name, row_figures in figures["rows"].items():
            loaded = {"loaded_mib": figures["loaded_mib"], "loaded_file_mib": figures["loaded_file_mib"]}
            results[f"{precision}/{name}/{library}"].update({**loaded, **row_figures})
    phases["memory_s"] = round(time.perf_counter() - started - phases["load_s"] - phases["timing_s"], 1)
    for precision in precisions:
        for name in rows:
            ours_mib = results[f"{precision}/{name}/ropelab"]["added_mib"]
            hf_mib = results[f"{precision}/{name}/hf"]["added_mib"]
            ratios[f"{precision}/{name}"]["peak_memory"] = round(ours_mib / hf_mib, 4) if hf_mib > 0 else None

    targets = {}
    for precision in precisions:
        for name in rows:
            key = f"{precision}/{name}"
            targets[f"{key}/speed"] = target(ratios[key]["speed"], SPEED_TARGETS[name], True)
            if name in MEMORY_TARGETS and ratios[key]["peak_memory"] is not None:
                targets[f"{key}/peak_memory"] = target(ratios[key]["peak_memory"], MEMORY_TARGETS[name], False)
            for which in FLOORS:
                ours = results[f"{key}/ropelab"]
                for label, floor in ((which, ours.get(which)), (f"own_process_{which}",
                                                                 ours.get("own_process", {}).get(which))):
                    if name in GEMM_FLOOR_TARGETS and floor is not None:
                        targets[f"{key}/{label}"] = target(floor, GEMM_FLOOR_TARGETS[name], False)

    print(f"median of {args.reps} alternating runs after {args.warmup} warm-up run(s); GEMM floors: median over "
          f"{args.reps} profiled steps in a row of each step's wall over its own products; peak memory: peak RSS of a "
          f"fresh process (forward: 1 run, train: 2 steps) minus its RSS after loading (one process per "
          f"{'(library, row)' if isolate == 'row' else 'library'})")
    print(f"{'row':<10} {'prec':<5} {'library':<8} {'tokens':>7} {'median s':>9} {'tokens/s':>9} "
          f"{'peak MiB':>9} {'loaded':>7} {'GEMM s':>7} {'attn s':>7} {'step/GEMM':>9} {'/(G+attn)':>9}")
    for key, r in results.items():
        precision, name, library = key.split("/")
        gemm, attention = ("-" if r.get(k) is None else f"{r[k]:.3f}" for k in ("gemm_s", "attention_s"))
        floor, products = ("-" if r.get(k) is None else f"{r[k]:.2f}x" for k in FLOORS)
        print(f"{name:<10} {precision:<5} {library:<8} {str(r['batch']) + 'x' + str(r['seq']):>7} {r['median_s']:9.3f} "
              f"{r['tokens_per_s']:9.0f} {r['added_mib']:9.0f} {r['loaded_mib']:7.0f} {gemm:>7} {attention:>7} {floor:>9} {products:>9}")
        if "own_process" in r:
            own = r["own_process"]
            print(f"{'':<33}own process (profiled alone): {own['gemm_s']:7.3f} {own['attention_s']:7.3f} "
                  f"{own['gemm_floor']:8.2f}x {own['product_floor']:8.2f}x")
    print("ropelab / HF:")
    for key, r in ratios.items():
        memory = "-" if r["peak_memory"] is None else f"{r['peak_memory']:.2f}x"
        line = (f"  {key:<16} speed {r['speed']:.2f}x (runs {r['speed_min']:.2f}-{r['speed_max']:.2f}), "
                f"peak memory {memory}")
        marks = [f"{what} {t['target']}: {'met' if t['met'] else 'NOT met'}"
                 for what in ("speed", "peak_memory", *FLOORS, *(f"own_process_{which}" for which in FLOORS))
                 if (t := targets.get(f"{key}/{what}"))]
        print(line + ("   targets: " + "; ".join(marks) if marks else ""))
    for key, pair in losses.items():
        print(f"  {key} first-step loss: ropelab {pair['ropelab']:.5f}, HF {pair['hf']:.5f}")
    print(json.dumps({
        "benchmark": "real_model", "model": SOURCE, "quick": args.quick,
        "layers": QUICK_LAYERS if args.quick else SMOLLM2_SHAPE.n_layer, "params": n_params,
        "hf_attn_implementation": hf_attn, "check_logits_max_abs_diff": logits_diff, "shape_mismatch": mismatch,
        "reps": args.reps, "warmup": args.warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": cpu, "loadavg": {"start": load_start, "after_timing": load_after_timing, "end": loadavg()},
        "memory_method": "peak RSS (VmHWM after clear_refs) over 1 forward / 2 training steps minus RSS after "
                         "loading, fresh process per "
                         + ("(library, row)" if isolate == "row" else "library"),
        "gemm_method": "gemm_floor: median over --reps consecutive torch.profiler-ed steps (after settle's) of "
                       "each step's wall seconds over its own summed self CPU seconds of GEMM_OPS; product_floor: "
                       "over GEMM_OPS plus ATTENTION_OPS; timed_product_floor: the timed median over the median "
                       "profiled step's GEMM_OPS plus ATTENTION_OPS; own_process: the same profiled steps in the "
                       "row's memory subprocess after its peak was read, glibc set as for the timed runs",
        "gemm_ops": list(GEMM_OPS), "attention_ops": list(ATTENTION_OPS),
        "reuse_freed_memory": args.reuse_freed_memory,
        "precisions": precisions, "not_measured": not_measured, "rows": rows,
        "results": results, "ratios": ratios, "first_losses": losses, "targets": targets,
        "all_targets_met": all(t["met"] for t in targets.values()),
        "phases": phases, "wall_s": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
