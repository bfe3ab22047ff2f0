"""The warm-start server of `ropelab.study.warm_start`: ``python -m ropelab.warm_server``.

Like ``python -m ropelab``, an entry point above the command line: it imports the trainer once, then
forks a ``ropelab <args>`` per request read from stdin (a JSON line: the arguments, the environment,
the log file, the working folder), reports each child's pid and, once the child has exited, its exit
code (minus the signal's number when a signal ended it) as JSON lines on stdout, and reaps the last
children when stdin closes. It runs no torch op itself, so that no thread pool exists when it forks.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback
from pathlib import Path

import ropelab
from ropelab.cli import main


def _report(reports: int, message: dict) -> None:
    try:
        os.write(reports, json.dumps(message).encode() + b"\n")
    except BrokenPipeError:  # the study has gone: its trainers run on
        pass


def _reap(reports: int, children: set[int], block: bool) -> None:
    """Report every child that has exited (with `block`, wait for all of them)."""
    while children:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _report(reports, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _trainer(request: dict) -> int:
    """In the forked child: become the trainer process the request describes; its exit code."""
    import torch  # imported by `serve` already

    os.setsid()
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh Python sets
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(Path(ropelab.__file__).with_name("__main__.py")), *request["args"]]
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0)))
    try:
        code = main(request["args"])
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # as a fresh Python ends on an uncaught Ctrl-C: killed by SIGINT
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    return code or 0


def _fork_trainer(request: dict, reports: int) -> int:
    """Fork the request's trainer; its pid (in the child: never returns)."""
    sys.stdout.flush()  # nothing the server printed may reach the trainer's log
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.close(reports)
        code = _trainer(request)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)


def serve() -> None:
    """Import the trainer, then fork a trainer per request until stdin closes; report every exit."""
    reports = os.dup(1)
    os.dup2(2, 1)  # what anything prints goes to the server's log, not among the reports
    import rich.console  # noqa: F401 - this and the checkpoint writer are imported by the trainer as it runs
    import rich.progress  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - the optimizer's first use imports it: 1 s of every trainer's start
    import torch.distributed.checkpoint  # noqa: F401
    import torch.optim  # noqa: F401

    import ropelab.distill  # noqa: F401 - what `ropelab train` imports when it runs
    import ropelab.train.loop  # noqa: F401
    import ropelab.train.run_folder  # noqa: F401

    _report(reports, {"ready": os.getpid()})
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap(reports, children, block=False)
        if not readable:
            continue
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            request = json.loads(line)
            try:
                pid = _fork_trainer(request, reports)
            except OSError as exc:
                _report(reports, {"request": request["request"], "error": f"fork failed: {exc}"})
                continue
            children.add(pid)
            _report(reports, {"request": request["request"], "pid": pid})
    _reap(reports, children, block=True)


if __name__ == "__main__":
    serve()
