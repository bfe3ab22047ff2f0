"""The one-line errors of a run that stops before its last step on a stop signal or on storage that
fails: which checkpoint was kept, and how to continue."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ropelab.errors import WriteFailed, one_line
from ropelab.train import checkpoint as ckpt
from ropelab.train.stop import StoppedBySignal, signal_name

def write_failed(run_dir: Path, exc: OSError) -> WriteFailed:
    latest = ckpt.latest_checkpoint(run_dir)
    kept = f"the newest complete checkpoint is {latest}" if latest else "no checkpoint was written"
    return WriteFailed(f"{run_dir}: {one_line(exc)}; {kept}; resume with --resume once there is room")


def stopped_by_signal(signum: Optional[int], step: int, run_dir: Path) -> StoppedBySignal:
    latest = ckpt.latest_checkpoint(run_dir)
    kept = f"checkpoint {latest}" if latest else "no checkpoint (every step so far was skipped)"
    return StoppedBySignal(signum, f"{run_dir}: stopped by {signal_name(signum)} at step {step}, {kept}; "
                                   f"resume with: ropelab train --out {run_dir} --resume")
