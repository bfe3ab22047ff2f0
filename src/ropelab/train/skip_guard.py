"""Which training steps are skipped before they touch the weights: non-finite or spiking losses."""

from __future__ import annotations

import statistics
from collections import deque
from pathlib import Path
from typing import Optional

from ropelab.config import RunConfig
from ropelab.errors import TrainingDiverged


class SkipGuard:
    """Decides whether a step's update is applied: non-finite loss or gradients (on any rank), or a
    loss above `spike_factor` x the median of the last `spike_window` applied steps."""

    def __init__(self, config: RunConfig):
        self.factor = config.train.spike_factor
        self.recent: deque[float] = deque(maxlen=config.train.spike_window)
        self.max_bad = config.train.max_bad_steps
        self.consecutive = 0
        self.skipped = 0

    def reason(self, finite: bool, loss: float) -> Optional[str]:
        if not finite:
            return "non-finite"
        if self.factor and len(self.recent) >= min(10, self.recent.maxlen) and loss > self.factor * statistics.median(self.recent):
            return "spike"
        return None

    def record(self, reason: Optional[str], loss: float) -> None:
        if reason is None:
            self.consecutive = 0
            self.recent.append(loss)
        else:
            self.consecutive += 1
            self.skipped += 1

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.max_bad

    def diverged(self, run_dir: Path, step: int, reason: Optional[str], good: Optional[Path]) -> TrainingDiverged:
        """The error that stops a run whose bad steps ran out at `step`, naming its last good checkpoint."""
        where = f"the last good checkpoint is {good}" if good else "no checkpoint was written before them"
        return TrainingDiverged(f"{run_dir}: {self.consecutive} consecutive bad steps (last: {reason} at step {step}); {where}")
