"""Command line: a thin layer over library functions. Each module of this package owns the table
of its commands (`COMMANDS`); `ropelab.cli.COMMANDS` is their concatenation, in help order.

Every command turns user mistakes (`ConfigError`) into one line on stderr and exit code 2, and a write
the storage failed (a full disk, a read-only file system: `WriteFailed`, `is_storage_error`) into one
line and exit code 1. A run or study stopped by SIGTERM or SIGUSR1 exits with 75 (EX_TEMPFAIL), by
Ctrl-C with 130, after one line saying how to continue (`ropelab.train.stop`).
Handlers import the library functions they call when they run, so that `ropelab --help` and the
argument checks start without importing torch and every feature.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ropelab.cli import claims, convert, data, evaluate, interchange, probe, study, train
from ropelab.cli.common import OVERRIDES_HELP, Command
from ropelab.config import ConfigError
from ropelab.errors import TrainingDiverged, WriteFailed, is_storage_error, one_line
from ropelab.train.stop import StoppedBySignal, exit_code

COMMANDS: list[Command] = [*train.COMMANDS, *study.COMMANDS, *interchange.COMMANDS, *convert.COMMANDS,
                           *evaluate.COMMANDS, *data.COMMANDS, *probe.COMMANDS, *claims.COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ropelab", description="Train, distill, evaluate and dissect RoPE in decoder-only LMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add_arguments, handler, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=OVERRIDES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(handler=handler)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. key=value pairs after an option (``convert SOURCE --out DIR k=v``) join
    the command's overrides: argparse fills a positional list once, before the options between."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not isinstance(getattr(args, "overrides", None), list) or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"ropelab: error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:
        print(f"ropelab: training stopped: {exc}", file=sys.stderr)
        return 1
    except WriteFailed as exc:
        print(f"ropelab: stopped: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if not is_storage_error(exc):
            raise
        print(f"ropelab: stopped: {one_line(exc)}", file=sys.stderr)
        return 1
    except StoppedBySignal as stopped:
        if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 speaks for every rank
            print(f"ropelab: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt as exc:
        # a second Ctrl-C, or SIGTERM while a trainer prepares its tokens (KeyboardInterrupt("SIGTERM"))
        signum = signal.Signals.__members__.get(str(exc), signal.SIGINT)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signum.name}"
        print(f"ropelab: {what}{_how_to_continue(args)}", file=sys.stderr)
        return exit_code(signum)


def _how_to_continue(args: argparse.Namespace) -> str:
    if args.command in ("study", "claims"):
        return "; re-run the same command to continue (finished runs are kept)"
    if not hasattr(args, "resume") or getattr(args, "cache", False):
        return ""
    if (Path(args.out) / "config.yaml").is_file():
        return f"; resume with: ropelab {args.command} --out {args.out} --resume"
    return "; nothing was trained yet: run the same command again"


if __name__ == "__main__":
    sys.exit(main())
