"""How a study trains its runs: `study.engine` (``eager`` or ``auto``) and what ``auto`` measures.

``eager`` is the plain path: every run a ``ropelab train`` process, ``--jobs`` at once, the CPU
threads split between them. ``auto`` keeps every run a process of its own (its folder is what an
eager run writes) but decides, per group of runs that share a model shape, sequence length, batch
and precision, from short trainings of one of the group's runs on this machine:

* the layout: one process on every core, or one single-thread process per core;
* compiled steps (``torch.compile``, inductor's C++ backend; only where a C++ compiler is found),
  with the inductor cache kept in ``DIR/engine/inductor`` for every run of the study. The compile
  time is counted: the first compiled probe fills the cache (its wall time is the group's first
  run's), a second one reads it, as the group's other runs will;
* the allocator: tcmalloc or jemalloc through ``LD_PRELOAD`` where one is installed;
* stacked members (`ropelab.train.stacked_loop`): the group's runs that start from nothing, up to
  ``STACK_MAX`` of them trained as one model in one process (HFTA), where `stack_refusal` allows it.
  Its probe trains that many copies stacked; the group's other runs (those that branch off another
  run) train as the best unstacked layout says.

``auto``'s trainers are forked from the study's warm-start server (`ropelab.study.warm_start`) instead
of starting a fresh Python each, with the CPU's matmul peak measured once for the study (`StudyPeaks`).

A probe trains ``PROBE_STEPS`` steps, started as the runs will be (warm, with the study's peaks), so
that its wall time holds a run's start-up; a run's time is estimated as the probe's wall time plus its
remaining steps at the probe's median step time, and a group's as that times its rounds of runs. A group
that trains fewer than ``MEASURED_FROM_STEPS`` steps in all is trained eager, unmeasured.
The layout is measured eager first, then compiled steps and the allocator on the faster layout, then
stacked members. Compiled and stacked steps round differently from eager ones, so they are chosen only
where they save at least ``ROUNDING_MARGIN`` of the time (a run's loss equals eager's to 1e-7 over tens
of steps, but a run on the edge of a loss drop can amplify that into a different final loss).
The choice and every figure go to ``DIR/engine.json`` (one line per group is printed); a study
continued later reuses them. Compiled runs get ``ROPELAB_COMPILE=1`` (read by the trainer), not a
config key, so their config.yaml is the eager run's.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import yaml

from ropelab.config import ConfigError
from ropelab.files import write_atomically
from ropelab.precision import matmul_dtype
from ropelab.study.grid import references
from ropelab.study.warm_start import WarmStarter, plain_start
from ropelab.train.distributed import resolve_device
from ropelab.train.loop import COMPILE_ENV
from ropelab.train.metrics import read_metrics
from ropelab.train.phases import resolve_phases
from ropelab.train.stacked_model import stack_refusal
from ropelab.train.throughput import measure_cpu_peak, peaks_environment

ENGINES = ("auto", "eager")
PROBE_STEPS = 16
WARMUP_STEPS = 4  # a probe's first steps (compilation, first touches) are left out of its step time
MEASURED_FROM_STEPS = 50 * PROBE_STEPS  # a group training fewer steps in all is not worth its probes: eager
RECORD = "engine.json"
ALLOCATOR_NAMES = ("libtcmalloc_minimal.so*", "libtcmalloc.so*", "libjemalloc.so*")
# Compiled and stacked steps round differently from eager ones: equal over tens of steps (1e-7 relative),
# but a run on the edge of a loss drop can amplify that (partial-scaling's rope25 seed 1, 3 layers of d_model
# 32: 1e-5 at step 54, a final validation loss 0.025 nats off compiled and 0.060 stacked). Such a path is
# taken only where its estimate saves at least this share over the best bitwise-equal one.
ROUNDING_MARGIN = 0.10
STACK_MAX = 16  # members of one stacked process: beyond this the step is long enough that stacking gains nothing


@dataclass(frozen=True)
class Layout:
    """How the runs of one group are trained: `processes` at once, `threads` each."""

    processes: int
    threads: int
    compile: bool = False
    allocator: Optional[str] = None  # a malloc library put in LD_PRELOAD
    stack: int = 1  # runs trained as one stacked model per process (`ropelab.train.stacked_loop`)

    def describe(self) -> str:
        parts = [f"{self.processes} x {self.threads} thread(s)", "compiled" if self.compile else "eager"]
        if self.allocator:
            parts.append(Path(self.allocator).name.split(".so")[0])
        if self.stack > 1:
            parts.append(f"{self.stack} runs stacked")
        return ", ".join(parts)

    def environment(self, study_dir: Path) -> dict[str, str]:
        """What a trainer of this layout gets on top of the study's environment."""
        env = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if self.compile:
            env[COMPILE_ENV] = "1"
            env["TORCHINDUCTOR_CACHE_DIR"] = str(study_dir / "engine" / "inductor")
        if self.allocator:
            env["LD_PRELOAD"] = " ".join(filter(None, [self.allocator, os.environ.get("LD_PRELOAD", "")]))
        return env


def eager_layout(jobs: int, cores: int) -> Layout:
    """Today's path: `jobs` processes, the cores split between them."""
    return Layout(max(1, jobs), max(1, cores // max(1, jobs)))


def cpp_compiler() -> Optional[str]:
    """The C++ compiler inductor's CPU backend would call, or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def installed_allocator() -> Optional[str]:
    """A tcmalloc or jemalloc shared library on this machine, or None."""
    folders = [sysconfig.get_config_var("LIBDIR") or "", os.path.join(sys.prefix, "lib"), "/usr/lib/x86_64-linux-gnu",
               "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    for pattern in ALLOCATOR_NAMES:
        for folder in folders:
            found = sorted(glob.glob(os.path.join(folder, pattern)))
            if found:
                return found[0]
    return None


def group_key(config) -> str:
    """Runs that share this train at the same speed: model shape, sequence length, batch, precision."""
    m, t = config.model, config.train
    return (f"L{m.n_layer}-d{m.d_model}-h{m.n_head}-kv{m.n_kv_head}-ff{m.d_ff}-T{config.data.seq_len}"
            f"-b{t.micro_batch}x{t.grad_accum}-{t.precision}")


class StudyPeaks:
    """The CPU's matmul peak (the MFU's denominator), measured once per study for each dtype and thread
    count its trainers use and handed to them in the environment (`ropelab.train.throughput.PEAKS_ENV`),
    instead of once in every trainer's start-up."""

    def __init__(self):
        self.peaks: dict[tuple, float] = {}  # (dtype, threads) -> FLOP/s

    def environment(self, tree: dict, threads: int) -> dict[str, str]:
        """What a trainer of the run `tree` on `threads` threads gets: every peak measured so far, its own included."""
        train = tree.get("train", {})
        try:
            device = resolve_device(train.get("device", "auto"), None)
        except ConfigError:  # the trainer says so in one line
            return {}
        if device.type != "cpu":
            return {}
        dtype = matmul_dtype(device, train.get("precision") == "bf16", train.get("bf16_gemm", "auto"))
        if (dtype, threads) not in self.peaks:
            self.peaks[dtype, threads] = measure_cpu_peak(dtype, threads)
        return peaks_environment(self.peaks)


def trainer_command(members: list[tuple[Path, Path]]) -> list[str]:
    """The ``ropelab`` arguments that train each (config file, run folder) of `members`: one run with
    ``train``, or several stacked in one process with ``train-stacked``."""
    if len(members) == 1:
        config, out = members[0]
        return ["train", "--config", str(config), "--out", str(out), "--no-progress"]
    return ["train-stacked", *[arg for config, out in members for arg in ("--member", str(config), str(out))]]


def trainer_layout(layout: Layout) -> Layout:
    """What a process of `layout` runs as: a stacked process trains its own batched model, not compiled."""
    return replace(layout, compile=False) if layout.stack > 1 else layout


@dataclass
class Probe:
    wall_s: float  # the slowest of the probe's processes, start to exit (setup and compilation included)
    step_s: float  # median step time after the warm-up steps


def run_probes(tree: dict, layout: Layout, folder: Path, study_dir: Path, steps: int = PROBE_STEPS,
               starter: Optional[WarmStarter] = None, peaks: Optional[StudyPeaks] = None) -> Probe:
    """Train `layout.processes` copies of the run at once for `steps` steps each, started as the study's
    runs are (from `starter`, with the study's `peaks`), so that the wall time counts their start-up."""
    tree = json.loads(json.dumps(tree))
    tree["train"].update(steps=steps, phases=[], eval_every=steps, eval_batches=1, checkpoint_every=steps, tensorboard=False, progress=False, checkpoint_steps=[])
    for key in ("tokens", "init_from", "branch_from", "branch_step", "warmup_steps"):  # the run's own schedule
        tree["train"].pop(key, None)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "probe.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    env = {**os.environ, **trainer_layout(layout).environment(study_dir),
           **(peaks.environment(tree, layout.threads) if peaks else {})}
    logs = [folder / f"p{i}.log" for i in range(layout.processes)]
    members = {i: [folder / f"p{i}" / f"m{j}" for j in range(layout.stack)] if layout.stack > 1 else [folder / f"p{i}"]
               for i in range(layout.processes)}
    start = time.perf_counter()
    processes = [(starter.start if starter else plain_start)(trainer_command([(folder / "probe.yaml", out) for out in members[i]]), env, log)
                 for i, log in enumerate(logs)]
    for process, log in zip(processes, logs):
        if process.wait() != 0:
            raise RuntimeError(f"engine probe ({layout.describe()}) failed: " + log.read_text(errors="replace")[-800:])
    wall = time.perf_counter() - start
    steps = [statistics.median(1.0 / row["tokens_per_s"] for row in read_metrics(members[i][0])
                               if row.get("step", 0) > WARMUP_STEPS and row.get("tokens_per_s"))
             for i in range(layout.processes)]
    tokens_per_step = tree["train"].get("micro_batch", 1) * tree["train"].get("grad_accum", 1) * tree["data"]["seq_len"]
    shutil.rmtree(folder, ignore_errors=True)
    return Probe(wall, statistics.fmean(steps) * tokens_per_step)


def estimate_s(probe: Probe, layout: Layout, runs: int, steps: int, probe_steps: int = PROBE_STEPS) -> float:
    """The group's estimated time: its rounds of `layout.processes` processes (each `layout.stack` runs),
    each probe wall + remaining steps."""
    per_run = probe.wall_s + max(0, steps - probe_steps) * probe.step_s
    return math.ceil(runs / (layout.processes * layout.stack)) * per_run


def choose_layout(tree: dict, runs: int, steps: int, cores: int, folder: Path, study_dir: Path,
                  measure: Callable[..., Probe] = run_probes, compiler: Optional[str] = "auto",
                  allocator: Optional[str] = "auto", probe_steps: int = PROBE_STEPS, alone: int = 0,
                  unstackable: Optional[str] = None) -> dict:
    """Measure the candidates for one group (module docstring); the record of the choice. `alone` of the
    `runs` start from nothing, and may be stacked unless `unstackable` says why not."""
    compiler = cpp_compiler() if compiler == "auto" else compiler
    allocator = installed_allocator() if allocator == "auto" else allocator
    measured, probes, estimates = [], {}, {}
    cold_compile_s = []  # what the first run of a compiled layout spends filling the inductor cache

    def trial(layout: Layout, estimate: Optional[Callable[[Probe], float]] = None) -> float:
        probe = probes[layout] = measure(tree, layout, folder, study_dir)
        extra = {}
        if layout.compile and not cold_compile_s:
            cold = probe
            probe = probes[layout] = measure(tree, layout, folder, study_dir)
            cold_compile_s.append(max(0.0, cold.wall_s - probe.wall_s))
            extra = {"cold_wall_s": round(cold.wall_s, 3)}
        seconds = estimate(probe) if estimate else estimate_s(probe, layout, runs, steps, probe_steps)
        seconds += cold_compile_s[0] if layout.compile else 0.0
        estimates[layout] = seconds
        measured.append({**asdict(layout), "wall_s": round(probe.wall_s, 3), "step_s": round(probe.step_s, 6), **extra,
                         "estimate_s": round(seconds, 2)})
        return seconds

    layouts = [Layout(1, cores)] + ([Layout(cores, 1)] if cores > 1 and runs > 1 else [])
    best = min(layouts, key=trial)
    notes = []
    if compiler is None:
        notes.append("no C++ compiler found: compiled steps not tried")
    else:
        compiled = Layout(best.processes, best.threads, compile=True)
        if trial(compiled) < (1 - ROUNDING_MARGIN) * estimates[best]:
            best = compiled
    if allocator is None:
        notes.append("no tcmalloc or jemalloc installed: glibc malloc")
    else:
        with_allocator = Layout(best.processes, best.threads, best.compile, allocator)
        if trial(with_allocator) < estimates[best]:
            best = with_allocator
    if unstackable is not None or alone < 2:
        notes.append(f"stacked members not tried: {unstackable or 'fewer than two runs start from nothing'}")
    else:
        members = min(STACK_MAX, math.ceil(alone / best.processes))
        stacked = replace(best, stack=members)
        best_probe = probes[best]

        def stacked_estimate(probe: Probe) -> float:  # the stacked runs, then the others as `best` trains them
            return (estimate_s(probe, stacked, alone, steps, probe_steps)
                    + (estimate_s(best_probe, best, runs - alone, steps, probe_steps) if runs > alone else 0.0))

        if trial(stacked, stacked_estimate) < (1 - ROUNDING_MARGIN) * estimates[best]:
            best = stacked
    return {"chosen": asdict(best), "measured": measured, "notes": notes, "runs": runs, "steps": steps,
            "probe_steps": probe_steps}


def decide(engine: str, groups: dict[str, list], study_dir: Path, jobs: int, cores: int,
           choose: Callable[..., dict] = choose_layout, echo: Callable[[str], None] = print) -> dict[str, Layout]:
    """The layout of every group: the eager one, or (auto) measured now or read from DIR/engine.json."""
    if engine == "eager":
        return {key: eager_layout(jobs, cores) for key in groups}
    path = study_dir / RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    if record.get("cores") != cores:
        record = {"engine": "auto", "cores": cores, "groups": {}}
    layouts = {}
    for key, runs in groups.items():
        alone = [run for run in runs if not references(run.config)]  # a run that starts from another run waits for it
        if key not in record["groups"]:
            steps = max(resolve_phases(run.config)[-1].end for run in runs)
            why_eager = ("every run of the group needs another run first: nothing to measure" if not alone else
                         f"{steps * len(runs)} steps in all, too few to pay for measuring" if steps * len(runs) < MEASURED_FROM_STEPS
                         else None)
            if why_eager:
                record["groups"][key] = {"chosen": asdict(eager_layout(jobs, cores)), "measured": [], "notes": [why_eager]}
            else:
                try:
                    record["groups"][key] = choose(alone[0].config.to_dict(), len(runs), steps, cores,
                                                   study_dir / "engine" / "probe", study_dir, alone=len(alone),
                                                   unstackable=stack_refusal([run.config for run in alone]))
                except RuntimeError as exc:  # a probe that cannot train says so; the runs themselves still can
                    record["groups"][key] = {"chosen": asdict(eager_layout(jobs, cores)), "measured": [],
                                             "notes": [f"eager: {' '.join(str(exc).split())[:300]}"]}
            write_atomically(path, json.dumps(record, indent=2))
        entry = record["groups"][key]
        layouts[key] = Layout(**entry["chosen"])
        figures = ", ".join(f"{Layout(**{k: m[k] for k in ('processes', 'threads', 'compile', 'allocator', 'stack') if k in m}).describe()}"
                            f" ~{m['estimate_s']:.0f} s" for m in entry["measured"])
        echo(f"engine {key} ({len(runs)} runs): {layouts[key].describe()}" + (f" [measured: {figures}]" if figures else "")
             + "".join(f"; {note}" for note in entry["notes"]))
    return layouts


__all__ = ["COMPILE_ENV", "ENGINES", "Layout", "STACK_MAX", "StudyPeaks", "choose_layout", "cpp_compiler", "decide", "eager_layout",
           "group_key", "installed_allocator", "trainer_command", "trainer_layout"]
