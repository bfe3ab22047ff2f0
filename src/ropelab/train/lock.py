"""One trainer per run directory.

`RunLock(run_dir)` holds an exclusive ``fcntl.flock`` on ``run_dir/.lock`` for as long as the trainer
runs (rank 0 takes it; the other ranks of the same job do not). The kernel drops the lock when the
holding process exits in any way, SIGKILL and out-of-memory kills included, so a dead run never
leaves a stale lock: the file stays, with the last holder's pid, host and start time, but nothing
holds it. A second trainer on the same directory gets `RunLocked` (a ConfigError: one line naming
the holder). `is_locked(run_dir)` tells the study runner whether a run is live, and who runs it. The
study runner holds the same kind of lock on its study folder (`role="study"`: one study per folder)
and, for a moment, on a run folder while it decides what to do with it (no trainer starts meanwhile).

The file is never deleted (deleting a lock file lets two processes lock two different files of one
name). A process forked by the holder (not exec'd: the descriptor is close-on-exec) shares the lock
until it exits too. On network file systems flock is only as good as the server's lock support
(NFSv4: yes; some FUSE file systems: no).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from ropelab.config import ConfigError

LOCK_FILE = ".lock"


class RunLocked(ConfigError):
    """Another live process holds the run directory's lock."""


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not yet written its pid"


def _holder(path: Path) -> str:
    try:
        return _describe(path.read_text())
    except OSError:
        return _describe("")


class RunLock:
    """Exclusive lock on ``run_dir/.lock``: ``with RunLock(run_dir): train(...)``, or `acquire` /
    `release`. `wait` seconds of retrying ride out a brief `is_locked` probe by another process.
    `role` names the holder in the refusal ("another trainer is running in it")."""

    def __init__(self, run_dir: Path, wait: float = 1.0, role: str = "trainer"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.wait = wait
        self.role = role
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: already held by this RunLock")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunLocked(f"{self.run_dir}: another {self.role} is running in it ({_holder(self.path)}); "
                                    "wait for it to finish or stop it") from None
                time.sleep(0.05)
            except OSError:
                os.close(fd)
                raise
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now().astimezone().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError:  # a full disk: not held, rather than held by a descriptor no one will close
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Unlock (the file is emptied first, so no one reads a finished holder's pid)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor of the open file drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def is_locked(run_dir: Path) -> Optional[str]:
    """The live holder of `run_dir`'s lock ("pid 123 on host, started 2025-01-01T12:00:00+00:00"),
    or None when no process holds it. Probes with a shared lock held for microseconds."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


__all__ = ["RunLock", "RunLocked", "is_locked", "LOCK_FILE"]
