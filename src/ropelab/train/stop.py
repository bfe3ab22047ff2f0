"""Stopping on a signal without losing work.

SIGTERM (what SLURM, Kubernetes and preemptible clouds send before SIGKILL, and `kill`'s
default), SIGUSR1 (SLURM's `--signal=USR1@SECONDS`) and SIGINT (Ctrl-C) ask the training loop to
stop at the next step boundary with a checkpoint; under torchrun every rank stops at the same
step. The process then exits with `exit_code`: 75 (EX_TEMPFAIL, "try again") after SIGTERM or
SIGUSR1, 130 after Ctrl-C. `ropelab study` forwards the same signals to its trainers.

Imports nothing heavy: the command line catches `StoppedBySignal` before torch is loaded.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from ropelab.train.distributed import DistEnv

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EX_TEMPFAIL = 75  # sysexits.h: a temporary failure, the same command again continues
INTERRUPTED = 130  # the shell's code for Ctrl-C (128 + SIGINT)


def exit_code(signum: Optional[int]) -> int:
    return INTERRUPTED if signum == signal.SIGINT else EX_TEMPFAIL


def signal_name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum else "a signal to another rank"


class StoppedBySignal(KeyboardInterrupt):
    """Raised once a run (or a study) has stopped on a stop signal with what it needs to continue
    saved. A KeyboardInterrupt, so that callers that handle Ctrl-C handle it too."""

    def __init__(self, signum: Optional[int], message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopSignals:
    """While open, the stop signals are recorded (`received`) instead of ending the process. With
    `second_interrupt_aborts`, a Ctrl-C after the first stop signal raises KeyboardInterrupt at once
    (saving nothing); a repeated SIGTERM or SIGUSR1 is only recorded: schedulers follow up with
    SIGKILL, and a job step's processes can get the same signal twice (from SLURM and forwarded by
    torchrun), which must not cut the checkpoint being written short. Handlers are installed only
    in the main thread, and a signal the process was told to ignore stays ignored (a background
    job's SIGINT); `close` restores the previous handlers."""

    def __init__(self, second_interrupt_aborts: bool = True):
        self.second_interrupt_aborts = second_interrupt_aborts
        self.received: list[int] = []
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        first = not self.received
        self.received.append(signum)
        if not first and signum == signal.SIGINT and self.second_interrupt_aborts:
            raise KeyboardInterrupt

    @property
    def signum(self) -> Optional[int]:
        """The first stop signal received, or None."""
        return self.received[0] if self.received else None

    def requested_on_any_rank(self, env: DistEnv, device: torch.device) -> bool:
        """Collective: every rank gets the same answer, so that all stop at the same step."""
        return not env.all_true(not self.received, device)

    def close(self) -> None:
        for signum, handler in self.previous.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(signum, handler)
        self.previous = {}

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
