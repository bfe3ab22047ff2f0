"""Run a study: every planned run as an ordinary training run under ``DIR/runs/<id>/``.

Each run is a separate ``ropelab train`` process (a crash stays in its run): with the ``eager``
engine a fresh Python, up to ``jobs`` at once, with the CPU threads split between them; with ``auto``
forked from the study's warm-start server (`ropelab.study.warm_start`) in the layout that
`ropelab.study.engine` measured, with the CPU's matmul peak measured once for the study instead of in
every trainer. Where that layout stacks members, runs of the group that start from nothing train
together in one ``ropelab train-stacked`` process (`ropelab.train.stacked_loop`), each into its own
folder as a run of its own would; a diverging member fails alone, and a member stopped by a signal
continues alone next time. Finished runs (``result.json``) are skipped, unfinished ones resume from their last
checkpoint, failed ones get ``error.txt`` and are retried on the next invocation. ``DIR/study.yaml`` records the grid;
a directory holding another grid is refused. A run that refers to another (``"@<id>"``, e.g. a
student's teacher) waits until that run is done, and is skipped if it failed. With ``teacher_cache``
the KD runs that share a teacher and their batches read one cache of its targets, written before the
first of them starts (a teacher of the study: once it is done).
SIGTERM, SIGUSR1 or Ctrl-C to the study goes on to its running trainers, which save a checkpoint
and stop (`ropelab.train.stop`); the study waits for them, marks them interrupted and raises
`StoppedBySignal`: the same command again continues every run.

Nothing in a run folder is another process's to lose: the study holds a lock on its folder for as
long as it runs (a second study on it stops in one line, `RunLocked`), and the run's own lock
(`ropelab.train.lock`) while it decides, right before starting a trainer, whether the run is done,
resumes or starts afresh (removing what an attempt before its first checkpoint left). A run whose
lock another process holds (a `ropelab train` started by hand) is `elsewhere`: left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import yaml

from ropelab.config import ConfigError, build_run_config
from ropelab.files import refuse_links_out, write_atomically
from ropelab.sources.init import run_config
from ropelab.sources.runs import CONFIG, RESULT
from ropelab.study.frontier import read_study_record
from ropelab.study.engine import (
    Layout, StudyPeaks, choose_layout, decide, group_key, run_probes, trainer_command, trainer_layout,
)
from ropelab.study.grid import PlannedRun, StudyConfig, expand, references, resolve_references
from ropelab.study.teacher_cache import shared_caches, write_shared_cache
from ropelab.study.warm_start import WarmStarter, WarmTrainer, plain_start
from ropelab.train.checkpoint import latest_checkpoint
from ropelab.train.lock import RunLock, RunLocked, is_locked
from ropelab.train.metrics import read_metrics
from ropelab.train.phases import resolve_phases
from ropelab.train.stop import EX_TEMPFAIL, INTERRUPTED, STOP_SIGNALS, StoppedBySignal, StopSignals, signal_name


@dataclass
class RunState:
    run: PlannedRun
    status: str = "queued"  # queued, running, done, failed, interrupted (stopped by a signal), skipped, elsewhere
    process: Union[subprocess.Popen, WarmTrainer, None] = None
    layout: Optional[Layout] = None  # processes, threads, compiled steps, allocator, stack (`ropelab.study.engine`)
    log: Optional[Path] = None  # where its trainer writes, when not the run's own train.log (a stacked process)
    stackable: bool = True  # False once the run has a checkpoint of its own to resume: it trains alone


def run_dir(study_dir: Path, run_id: str) -> Path:
    return study_dir / "runs" / run_id


def record_study(study_dir: Path, study: StudyConfig, runs: list[PlannedRun]) -> None:
    """Write DIR/study.yaml, or check that the directory holds this same grid."""
    record = {"name": study.name, "runs": {r.id: r.config.to_dict() for r in runs}}
    if any(r.frontier for r in runs):
        record["frontier"] = {r.id: dataclasses.asdict(r.frontier) for r in runs if r.frontier}
    path = study_dir / "study.yaml"
    if path.exists():
        old = read_study_record(study_dir).get("runs", {})
        if set(old) != set(record["runs"]) or any(not _same_config(old[k], record["runs"][k]) for k in old):
            raise ConfigError(f"{study_dir}: holds runs from a different grid ({path.name} differs); choose another --out")
        return
    study_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(path, yaml.safe_dump(record, sort_keys=False))


def _same_config(recorded, config: dict) -> bool:
    """Whether a run recorded in study.yaml is `config`: equal as read back by today's config, so that a
    study written before a key was added (its default then implied) goes on."""
    if recorded == config:
        return True
    try:
        return isinstance(recorded, dict) and build_run_config(recorded).to_dict() == config
    except ConfigError:
        return False


def initial_status(directory: Path) -> str:
    """done (result.json), elsewhere (another trainer holds the run's lock: left alone), or queued."""
    if (directory / RESULT).is_file():
        return "done"
    if is_locked(directory):
        return "elsewhere"
    return "queued"


def resolved_tree(run: PlannedRun, study_dir: Path) -> dict:
    """The run's config as a dict, each ``"@<run id>"`` replaced by that run's folder."""
    targets = {target: str(run_dir(study_dir, target)) for _, target in references(run.config)}
    return resolve_references(run.config, targets)


def _write_cache(state: RunState, study_dir: Path, caches: dict[str, Path]) -> bool:
    """The teacher targets of the run's group, written before its first run starts (the loop waits for
    them; trainers already running go on). A teacher that cannot give them fails the run, with the
    reason in its error.txt; the study goes on."""
    config = state.run.config
    try:
        if references(config):
            config = run_config(resolved_tree(state.run, study_dir))
        write_shared_cache(state.run.id, config, caches)
    except (ConfigError, RuntimeError, OSError) as exc:
        directory = run_dir(study_dir, state.run.id)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "error.txt").write_text(f"teacher targets: {exc}\n")
        state.status = "failed"
        return False
    return True


def _command(state: RunState, directory: Path, cache: Optional[Path]) -> list[str]:
    """The arguments of the run's ``ropelab train``."""
    plan = _plan(state, directory, cache)
    if plan is None:
        return ["train", "--out", str(directory), "--no-progress", "--resume"]
    return trainer_command([(plan, directory)])


def _plan(state: RunState, directory: Path, cache: Optional[Path]) -> Optional[Path]:
    """The run's config for a fresh start, written to DIR/plan/<id>.yaml; None when it resumes from a checkpoint."""
    if latest_checkpoint(directory) is not None:
        return None
    # never started, or died before its first checkpoint: start it afresh
    for name in (CONFIG, "metrics.jsonl", "error.txt"):
        (directory / name).unlink(missing_ok=True)
    study_dir = directory.parent.parent
    plan = study_dir / "plan" / f"{state.run.id}.yaml"
    plan.parent.mkdir(parents=True, exist_ok=True)
    tree = resolved_tree(state.run, study_dir)
    if cache is not None:  # the study's shared teacher targets (`ropelab.study.teacher_cache`)
        tree["distill"]["logits_cache"] = str(cache)
    plan.write_text(yaml.safe_dump(tree, sort_keys=False))
    return plan


def _start(state: RunState, directory: Path, cache: Optional[Path] = None, starter: Optional[WarmStarter] = None,
           peaks: Optional[StudyPeaks] = None) -> None:
    """Start the run's trainer (from `starter` where given, with the study's `peaks`), unless another
    process has finished the run or holds it by now."""
    try:
        with RunLock(directory):  # no trainer starts in it while the study reads and cleans it
            if (directory / RESULT).is_file():
                state.status = "done"
                return
            command = _command(state, directory, cache)
            (directory / "error.txt").unlink(missing_ok=True)
    except RunLocked:
        state.status = "elsewhere"
        return
    _launch([state], command, state.layout, directory / "train.log", directory.parent.parent, starter, peaks)


def _launch(states: list[RunState], command: list[str], layout: Layout, log: Path, study_dir: Path,
            starter: Optional[WarmStarter], peaks: Optional[StudyPeaks]) -> None:
    """Start the trainer process of `states` (one run, or the members of a stack) in `layout`'s environment
    with the study's `peaks`, from `starter` where given."""
    env = {**os.environ, **layout.environment(study_dir)}
    if peaks is not None:
        env.update(peaks.environment(states[0].run.config.to_dict(), layout.threads))
    process = (starter.start if starter else plain_start)(command, env, log)
    for state in states:
        state.process, state.status = process, "running"


def _start_stack(members: list[RunState], study_dir: Path, starter: Optional[WarmStarter] = None,
                 peaks: Optional[StudyPeaks] = None) -> None:
    """Start `members` (runs of one group that start from nothing) stacked in one process. A member that
    another process has finished or holds by now is marked so; one with a checkpoint waits to resume alone."""
    planned = []
    for state in members:
        directory = run_dir(study_dir, state.run.id)
        try:
            with RunLock(directory):
                if (directory / RESULT).is_file():
                    state.status = "done"
                elif latest_checkpoint(directory) is not None:
                    state.stackable = False
                else:
                    planned.append((state, _plan(state, directory, None), directory))
        except RunLocked:
            state.status = "elsewhere"
    if not planned:
        return
    states = [state for state, _, _ in planned]
    command = trainer_command([(plan, directory) for _, plan, directory in planned])
    if len(planned) == 1:  # the others are done, held or resume alone: a run of its own
        _launch(states, command, states[0].layout, planned[0][2] / "train.log", study_dir, starter, peaks)
        return
    log = study_dir / "engine" / "stacks" / f"{states[0].run.id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _launch(states, command, trainer_layout(states[0].layout), log, study_dir, starter, peaks)
    for state in states:
        state.log = log


def _stack_companions(state: RunState, states: list[RunState], caches: dict[str, Path]) -> Optional[list[RunState]]:
    """The queued runs that start stacked with `state` (itself first), or None when it trains alone."""
    def stackable(s: RunState) -> bool:
        return (s.status == "queued" and s.stackable and s.layout is not None and s.layout.stack > 1
                and not references(s.run.config) and s.run.id not in caches)

    if not stackable(state):
        return None
    key = group_key(state.run.config)
    others = [s for s in states if s is not state and stackable(s) and group_key(s.run.config) == key]
    return [state, *others[:state.layout.stack - 1]]


def _finish(state: RunState, directory: Path) -> None:
    code = state.process.wait()
    # a stacked member is done once its result is written, whatever became of the other members
    if (directory / RESULT).is_file() and (code == 0 or state.log is not None):
        state.status = "done"
        return
    if code in (EX_TEMPFAIL, INTERRUPTED) or -code in STOP_SIGNALS:  # its checkpoint (if any) continues it next time
        state.status = "interrupted"
        return
    if is_locked(directory):  # another process took the run between the study's check and its trainer's start
        state.status = "elsewhere"
        return
    state.status = "failed"
    if state.log is not None and (directory / "error.txt").is_file():  # the stacked trainer's own line (diverged)
        return
    tail = (state.log or directory / "train.log").read_text(errors="replace").strip().splitlines()[-20:]
    (directory / "error.txt").write_text(f"exit code {code}\n" + "\n".join(tail) + "\n")


def _overview(states: list[RunState], study_dir: Path):
    from rich.table import Table

    table = Table(title=f"study {study_dir}")
    for col in ("run", "status", "step", "loss", "val loss"):
        table.add_column(col)
    style = {"done": "green", "running": "yellow", "failed": "red", "queued": "dim", "skipped": "red", "elsewhere": "yellow",
             "interrupted": "yellow"}
    for s in states:
        rows = read_metrics(run_dir(study_dir, s.run.id))
        last = rows[-1] if rows else {}
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        table.add_row(s.run.id, f"[{style[s.status]}]{s.status}", f"{last.get('step', 0)}/{resolve_phases(s.run.config)[-1].end}",
                      f"{last['loss']:.3f}" if "loss" in last else "", f"{vals[-1]:.3f}" if vals else "")
    return table


def run_study(study: StudyConfig, study_dir: str | Path, jobs: int = 1, live: bool = True,
              engine: Optional[str] = None) -> dict[str, str]:
    """Run (or continue) every run of `study` in `study_dir`; returns {run id: status}.

    `engine` (default: `study.engine`) is ``eager`` (`jobs` trainers at once, the cores split between
    them) or ``auto`` (a layout per group of runs, measured: `ropelab.study.engine`)."""
    study_dir = Path(study_dir)
    runs = expand(study)
    with RunLock(study_dir, role="study"):  # before study.yaml: a second study on the folder stops here
        return _run_locked(study, runs, study_dir, jobs, live, engine or study.engine)


def _fits(state: RunState, states: list[RunState], jobs: int, engine: str, cores: int) -> bool:
    """Whether the run may start now: eager, below `jobs` trainers; auto, its threads within the cores."""
    running = _processes(states)
    if engine == "eager":
        return len(running) < jobs
    return not running or sum(s.layout.threads for s in running) + state.layout.threads <= cores


def _processes(states: list[RunState]) -> list[RunState]:
    """One running run per trainer process (the members of a stack share theirs)."""
    return list({id(s.process): s for s in states if s.status == "running"}.values())


def _run_locked(study: StudyConfig, runs: list[PlannedRun], study_dir: Path, jobs: int, live: bool,
                engine: str) -> dict[str, str]:
    from rich.console import Console

    refuse_links_out(study_dir, "ropelab study")  # it cleans and writes in its runs too (train.log, error.txt)
    record_study(study_dir, study, runs)
    states = [RunState(r, initial_status(run_dir(study_dir, r.id))) for r in runs]
    caches = shared_caches(runs, study_dir) if study.teacher_cache else {}
    jobs, cores = max(1, jobs), os.cpu_count() or 1
    queued = [s for s in states if s.status == "queued"]
    groups: dict[str, list[PlannedRun]] = {}
    for s in queued:
        groups.setdefault(group_key(s.run.config), []).append(s.run)
    console = Console()
    # auto: trainers forked from one warm process, the CPU's peak measured once (`ropelab.study.warm_start`)
    warm = engine == "auto" and bool(queued)
    with contextlib.ExitStack() as stack:
        starter = stack.enter_context(WarmStarter(study_dir / "engine" / "warm-start.log", console.print)) if warm else None
        peaks = StudyPeaks() if warm else None
        measure = functools.partial(run_probes, starter=starter, peaks=peaks)
        layouts = decide(engine, groups, study_dir, jobs, cores, choose=functools.partial(choose_layout, measure=measure))
        for s in queued:
            s.layout = layouts[group_key(s.run.config)]
            if peaks is not None:  # measured before any trainer loads the cores
                peaks.environment(s.run.config.to_dict(), s.layout.threads)
        return _train_runs(states, study_dir, jobs, live, engine, cores, caches, console, starter, peaks)


def _train_runs(states: list[RunState], study_dir: Path, jobs: int, live: bool, engine: str, cores: int,
                caches: dict[str, Path], console, starter: Optional[WarmStarter], peaks: Optional[StudyPeaks]) -> dict[str, str]:
    from rich.live import Live

    display_context = Live(_overview(states, study_dir), console=console, refresh_per_second=1) if live else contextlib.nullcontext()
    forwarded = 0
    with display_context as display, StopSignals(second_interrupt_aborts=False) as stop:
        while True:
            for s in states:
                if s.status == "running" and s.process.poll() is not None:
                    _finish(s, run_dir(study_dir, s.run.id))
            arrived = stop.received[forwarded:]
            forwarded += len(arrived)
            for signum in arrived:  # every one: a second Ctrl-C stops the trainers at once, as it stops `ropelab train`
                for s in _processes(states):
                    s.process.send_signal(signum)
            status = {s.run.id: s.status for s in states}
            for s in (states if stop.signum is None else []):  # nothing new starts once the study is stopping
                if s.status == "queued" and not _fits(s, states, jobs, engine, cores):
                    continue
                needs = [status[target] for _, target in references(s.run.config)]
                if s.status == "queued" and any(n in ("failed", "skipped", "elsewhere", "interrupted") for n in needs):
                    s.status = "skipped"
                elif s.status == "queued" and all(n == "done" for n in needs):
                    if s.run.id in caches and not _write_cache(s, study_dir, caches):
                        continue
                    stack = _stack_companions(s, states, caches)
                    if stack is not None:
                        _start_stack(stack, study_dir, starter, peaks)
                    else:
                        _start(s, run_dir(study_dir, s.run.id), caches.get(s.run.id), starter, peaks)
            running = sum(s.status == "running" for s in states)
            if display is not None:
                display.update(_overview(states, study_dir))
            if not running and (stop.signum is not None or not any(s.status == "queued" for s in states)):
                break
            if starter is not None:  # wakes as soon as a trainer ends
                starter.wait_for_exit(1.0)
            else:
                time.sleep(1.0)
    if not live:
        console.print(_overview(states, study_dir))
    if stop.signum is not None:
        stopped = sum(s.status == "interrupted" for s in states)
        raise StoppedBySignal(stop.signum, f"{study_dir}: stopped by {signal_name(stop.signum)} ({stopped} run(s) interrupted, "
                                           f"their checkpoints kept); re-run the same command to continue")
    return {s.run.id: s.status for s in states}

