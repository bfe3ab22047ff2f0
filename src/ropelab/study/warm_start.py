"""A warm start for a study's trainers: one server process that has imported torch and the trainer
once, and forks each trainer from there instead of starting a fresh Python: the study's side.

A fresh ``python -m ropelab train`` costs about 4-5 s before its first step on 2 cores (importing torch,
``torch._dynamo`` reached from the optimizer, the rest of ropelab), while a run of the claims' smallest
size trains 1-3 s. The server (``python -m ropelab.warm_server``, started by `WarmStarter` with one
OpenMP thread) imports all of it and runs no torch op, so that no thread pool exists when it forks. Each
request (a JSON line on its stdin: the CLI arguments, the environment, the log file, the working folder)
becomes a child that does what a fresh trainer process does: a session of its own, the request's
environment in place of the server's, stdout and stderr appended to the log, torch's threads set from
``OMP_NUM_THREADS`` (OpenMP read the variable when the server loaded it), Python's default signal
handlers, then ``ropelab <args>`` in-process and its exit code. The server is the children's parent:
it reaps them and reports each exit code (minus the signal's number when one killed it, as `Popen`
does) on its stdout.

`WarmStarter.start` gives a `WarmTrainer`, which answers as a `subprocess.Popen` does (`pid`, `poll`,
`wait`, `send_signal`, `returncode`): the study forwards signals to it and reads its exit code
unchanged. A trainer whose environment preloads another library (an allocator in ``LD_PRELOAD``)
cannot come from the server, and starts as a plain process (`plain_start`); so does every trainer
once the server cannot start or has ended (one line says so). A trainer running when the server
ended has no exit code to report: it counts as failed once it has gone (its checkpoints, if any,
continue it next time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Union

READY_TIMEOUT_S = 300.0  # importing torch on a loaded machine can take a while
REPLY_TIMEOUT_S = 60.0  # a fork answers at once
LOST = 1  # the exit code of a trainer whose server ended before reporting it
LOST_NOTE = "ropelab: the warm-start server ended before this trainer did; its exit code is unknown\n"


def plain_start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python -m ropelab <args>`` as a process of its own, stdout and stderr appended to `log`."""
    with open(log, "a") as stream:
        # a session of its own: a Ctrl-C in the terminal reaches the study alone, which forwards it once
        return subprocess.Popen([sys.executable, "-m", "ropelab", *args], stdout=stream, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


class WarmStarter:
    """The client of one warm-start server (module docstring); a context manager that ends it."""

    def __init__(self, server_log: Path, echo: Callable[[str], None] = print):
        self.echo = echo
        self.lock = threading.Condition()
        self.replies: dict[int, dict] = {}  # request number -> {"pid"} or {"error"}
        self.exits: dict[int, int] = {}  # pid -> exit code
        self.ready = False
        self.ended = False  # no trainer starts from the server any more
        self.reports_read = False  # the server has ended and every report of it is in `exits`
        self.requests = 0
        # one thread: with more, importing torch already starts an OpenMP worker, which a fork does not carry
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.server_log = server_log
        server_log.parent.mkdir(parents=True, exist_ok=True)
        with open(server_log, "a") as stderr:
            self.server = subprocess.Popen([sys.executable, "-m", "ropelab.warm_server"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=stderr, env=self.env, start_new_session=True)
        threading.Thread(target=self._read_reports, daemon=True).start()
        with self.lock:
            self.lock.wait_for(lambda: self.ready or self.reports_read, READY_TIMEOUT_S)
        if not self.ready:
            self._give_up(f"the server did not start in {READY_TIMEOUT_S:.0f} s (see {server_log})", kill=True)

    def __enter__(self) -> WarmStarter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the server: it reaps the trainers still running, then exits."""
        with self.lock:
            self.ended = True
        try:
            self.server.stdin.close()
            self.server.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.server.kill()
            self.server.wait()

    def _read_reports(self) -> None:
        for line in self.server.stdout:
            report = json.loads(line)
            with self.lock:
                if "ready" in report:
                    self.ready = True
                elif "request" in report:
                    self.replies[report["request"]] = report
                else:
                    self.exits[report["pid"]] = report["returncode"]
                self.lock.notify_all()
        with self.lock:
            self.reports_read = True
            self.lock.notify_all()
        self._give_up(f"the server ended (exit code {self.server.wait()}; see {self.server_log})")

    def _give_up(self, why: str, kill: bool = False) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
        self.echo(f"warm start: {why}; trainers start as plain processes")
        if kill:
            self.server.kill()

    def start(self, args: list[str], env: dict[str, str], log: Path) -> Union[WarmTrainer, subprocess.Popen]:
        """``ropelab <args>`` forked from the server, or a plain process where it cannot be."""
        if self.ended or env.get("LD_PRELOAD", "") != self.env.get("LD_PRELOAD", ""):
            return plain_start(args, env, log)
        with self.lock:
            request, self.requests = self.requests, self.requests + 1
        line = json.dumps({"request": request, "args": args, "env": env, "log": str(log), "cwd": os.getcwd()})
        try:
            self.server.stdin.write(line.encode() + b"\n")
            self.server.stdin.flush()
        except OSError as exc:
            self._give_up(f"the server is gone ({exc})")
            return plain_start(args, env, log)
        with self.lock:
            self.lock.wait_for(lambda: request in self.replies or self.reports_read, REPLY_TIMEOUT_S)
            reply = self.replies.pop(request, None)
        if reply is None or "error" in reply:
            self._give_up(reply["error"] if reply else "the server did not answer", kill=reply is None)
            return plain_start(args, env, log)
        return WarmTrainer(self, reply["pid"], log)

    def wait_for_exit(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, less once a trainer of the server exits."""
        with self.lock:
            reported = len(self.exits)
            self.lock.wait_for(lambda: len(self.exits) != reported or self.reports_read, timeout)


class WarmTrainer:
    """A trainer forked by the warm-start server, handled as a `subprocess.Popen`."""

    def __init__(self, starter: WarmStarter, pid: int, log: Path):
        self.starter, self.pid, self.log = starter, pid, log
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            with self.starter.lock:
                self.returncode = self.starter.exits.pop(self.pid, None)
                lost = self.returncode is None and self.starter.reports_read and not _alive(self.pid)
            if lost:
                with open(self.log, "a") as log:
                    log.write(LOST_NOTE)
                self.returncode = LOST
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"warm trainer {self.pid}", timeout)
            with self.starter.lock:
                self.starter.lock.wait_for(lambda: self.pid in self.starter.exits, left)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for init to reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
