"""Errors the CLI reports as one line. Configuration mistakes are `ConfigError` (also importable as
`ropelab.config.ConfigError`)."""

import errno


class ConfigError(ValueError):
    """A user's configuration is invalid. The message is one line naming the key."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive bad (non-finite or spiking) steps; the last good weights are in the
    run's latest checkpoint."""


class WriteFailed(RuntimeError):
    """A write of the run failed (a full disk, a vanished mount); what was written before is intact."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one line for a user-facing message: its type and the first line of its text."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__


def load_failure(exc: BaseException, trust_remote_code: bool, limit: int = 300) -> str:
    """`one_line(exc)` for a failed transformers load, except that its refusal to run Python code
    shipped with the model, config or tokenizer (`auto_map`) says how to allow it."""
    if not trust_remote_code and "trust_remote_code" in str(exc):
        return ("it ships Python code for transformers to run (auto_map), which ropelab runs only when asked: "
                "pass --trust-remote-code (trust_remote_code=True) if you trust it")
    return one_line(exc, limit)


# A full disk or quota, a read-only or failing file system: a command stops in one line, and what it
# wrote before (checkpoints and shards are renamed into place only when complete) stays as it was.
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def is_storage_error(exc: OSError) -> bool:
    """Whether an OSError means the storage is full, read-only or failing (not a bug of ours)."""
    return exc.errno in STORAGE_ERRORS
