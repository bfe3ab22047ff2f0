"""Errors the CLI reports as one line. Configuration mistakes are `ropelab.config.ConfigError`."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive bad (non-finite or spiking) steps; the last good weights are in the
    run's latest checkpoint."""


class WriteFailed(RuntimeError):
    """A write of the run failed (a full disk, a vanished mount); what was written before is intact."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one line for a user-facing message: its type and the first line of its text."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__
