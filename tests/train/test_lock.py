"""One trainer per run directory: RunLock's flock, held by a real second process, released by the
kernel when that process is SIGKILLed; is_locked for the study runner."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest

from ropelab.config import ConfigError
from ropelab.train.lock import LOCK_FILE, RunLock, RunLocked, is_locked

HOLD = """
import sys, time
from ropelab.train.lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""

TRY = """
import sys
from ropelab.train.lock import RunLock, RunLocked
try:
    RunLock(sys.argv[1], wait=0).acquire()
except RunLocked as exc:
    print(exc)
    sys.exit(3)
print("acquired")
"""


@pytest.fixture
def holder(tmp_path):
    """A second process holding the lock of tmp_path/run."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield run, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_lock_records_the_holder_and_is_released(tmp_path):
    run = tmp_path / "run"
    assert is_locked(run) is None  # no run directory yet
    before = datetime.now().astimezone().replace(microsecond=0)
    with RunLock(run) as lock:
        assert lock.held
        record = json.loads((run / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
        assert before <= datetime.fromisoformat(record["started"]) <= datetime.now().astimezone()
        described = is_locked(run)
        assert described == f"pid {os.getpid()} on {record['host']}, started {record['started']}"
        with pytest.raises(RuntimeError, match="already held"):
            lock.acquire()
    assert not lock.held and is_locked(run) is None
    assert (run / LOCK_FILE).exists()  # never deleted
    with RunLock(run):  # free again
        pass


def test_second_process_is_refused_with_the_holders_pid(tmp_path):
    run = tmp_path / "run"
    with RunLock(run):
        record = json.loads((run / LOCK_FILE).read_text())
        done = subprocess.run([sys.executable, "-c", TRY, str(run)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 3, done.stderr
        message = done.stdout.strip()
        assert "\n" not in message and f"pid {os.getpid()}" in message and record["started"] in message
        assert message.startswith(f"{run}: another trainer is running in it")
    done = subprocess.run([sys.executable, "-c", TRY, str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "acquired", done.stderr


def test_lock_held_by_another_process_then_sigkilled(holder):
    run, proc = holder
    with pytest.raises(RunLocked) as err:
        RunLock(run, wait=0).acquire()
    record = json.loads((run / LOCK_FILE).read_text())
    assert record["pid"] == proc.pid
    text = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in text
    assert f"pid {proc.pid}" in text and record["started"] in text
    assert f"pid {proc.pid}" in is_locked(run)
    started = time.monotonic()
    with pytest.raises(RunLocked):
        RunLock(run, wait=0.3).acquire()  # retries for `wait`, then gives up
    assert time.monotonic() - started >= 0.3

    proc.send_signal(signal.SIGKILL)  # no cleanup code runs: the kernel drops the flock
    proc.wait(timeout=30)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == proc.pid  # the stale record stays ...
    assert is_locked(run) is None  # ... but nothing holds the lock
    with RunLock(run, wait=0):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_acquire_rides_out_a_brief_probe(tmp_path):
    """is_locked takes a shared lock for an instant; a trainer starting then waits instead of failing."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text("")
    fd = os.open(run / LOCK_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe, held longer than any real one
    threading.Timer(0.3, os.close, (fd,)).start()
    with RunLock(run, wait=5):
        assert is_locked(run) is not None
    assert is_locked(run) is None


def test_release_is_idempotent(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    lock.release()
    lock.release()
    assert is_locked(tmp_path / "run") is None
