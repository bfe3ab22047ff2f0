"""Errors the CLI reports as one line. Configuration mistakes are `ConfigError` (also importable as
`ropelab.config.ConfigError`)."""

import errno
import reprlib

QUOTE_LIMIT = 200  # characters of an offending value an error message quotes
MESSAGE_LIMIT = 2000  # characters of a ConfigError's line


class ConfigError(ValueError):
    """A user's configuration is invalid. The message is one line naming the key; a message that would
    be longer, or span lines, is cut to its first `MESSAGE_LIMIT` characters on one line."""

    def __str__(self) -> str:
        return bounded(" ".join(super().__str__().splitlines()), MESSAGE_LIMIT)


class TrainingDiverged(RuntimeError):
    """Too many consecutive bad (non-finite or spiking) steps; the last good weights are in the
    run's latest checkpoint."""


class WriteFailed(RuntimeError):
    """A write of the run failed (a full disk, a vanished mount); what was written before is intact."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one line for a user-facing message: its type and the first line of its text."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__


def bounded(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the cut marked by an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


# repr of at most 20 items per list or mapping, 3 levels deep, 200 characters per string or number:
# bounded work however large, deep or shared the value is
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = _SHORT_REPR.maxlong = QUOTE_LIMIT
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 20


def quoted(value: object) -> str:
    """`repr(value)` for an error message: one line of at most `QUOTE_LIMIT` characters."""
    return bounded(_SHORT_REPR.repr(value), QUOTE_LIMIT)


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
