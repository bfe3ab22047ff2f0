"""The folder a new run trains into: new, empty, or holding only what ropelab leaves there before a run
starts. Anything else (a finished run's result.json or checkpoints without their config.yaml, files
of the user's own) is refused in one line, before anything is written: a run prunes checkpoints and
replaces result.json, so it never trains among files it did not write."""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError
from ropelab.files import output_folder
from ropelab.sources.runs import CONFIG
from ropelab.train.lock import RunLocked, is_locked

# What an attempt that stopped before its first checkpoint leaves, and a study's runner then restarts
# afresh (`ropelab.study.runner`): the lock file (never deleted, `ropelab.train.lock`), event files,
# unfinished checkpoint saves and atomic writes, and the runner's own log and error file.
LEFT_BEFORE_START = (".lock", "tensorboard", "checkpoints/.tmp_step_*", ".*.partial", "train.log", "error.txt")


def check_new_run_folder(run_dir: str | Path, probe_lock: bool = True) -> Path:
    """`run_dir` as a Path a new run may train into, or a one-line ConfigError (RunLocked while another
    trainer holds it: that one is still writing what the checks below would find). Without `probe_lock`
    the lock is left alone: the trainer's check after taking it (another run may have finished there
    between the first check and the lock), and the other ranks of a torchrun job (rank 0 holds it)."""
    run_dir = output_folder(run_dir, "ropelab train", own=None)
    holder = is_locked(run_dir) if probe_lock else None
    if holder:
        raise RunLocked(f"{run_dir}: another trainer is running in it ({holder}); wait for it to finish or stop it")
    if (run_dir / CONFIG).exists() or (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir}: already holds a run; pass --resume to continue it or choose another --out")
    return output_folder(run_dir, "ropelab train", LEFT_BEFORE_START)
