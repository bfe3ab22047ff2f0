"""Shared pieces of the fault-injection suite: the run every fault interrupts, how to damage a file,
crash a run or fail a write, and the comparison with an uninterrupted reference run."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ropelab.cli import main
from ropelab.sources.runs import read_result
from ropelab.train import checkpoint as ckpt
from ropelab.train.metrics import read_metrics

HERE = Path(__file__).parent
STEPS = 8  # TINY's
# TINY (tests/conftest.py) with a checkpoint every 2 steps and the last 2 kept, so that pruning runs
# (the step-6 save deletes step 2, the step-8 save step 4), and a run stopped after 2 bad steps.
EXTRA = ["train.checkpoint_every=2", "train.keep_checkpoints=2", "train.max_bad_steps=2"]
CHECKPOINT_FILES = ["dcp/__0_0.distcp", "dcp/.metadata", "model.safetensors", "state.pt", "rng_rank0.pt"]


def fault_overrides(tiny) -> list[str]:
    return [*tiny, *EXTRA]


def step_dir(run: Path, step: int) -> Path:
    return ckpt.step_dir(run, step)


def tmp_dir(run: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is renamed into place."""
    return ckpt.checkpoint_dir(run) / f".tmp_step_{step:08d}"


def listing(run: Path) -> list[str]:
    root = ckpt.checkpoint_dir(run)
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


# ------------------------------------------------------------------ the comparison


def losses(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run)]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir(run, STEPS) / ckpt.WEIGHTS))


def assert_same_run(run: Path, reference: Path, exact: bool = True) -> None:
    """`run` finished and equals the uninterrupted `reference`: the same train and validation loss at
    every step and at the end, and (`exact`) the same final weights bit for bit; every checkpoint it
    kept verifies and no partial one is left."""
    result, expected = read_result(run), read_result(reference)
    assert result is not None, f"{run}: did not finish (no result.json); checkpoints {listing(run)}"
    assert result["steps"] == expected["steps"] == STEPS
    assert (result["final_train_loss"], result["final_val_loss"]) == (expected["final_train_loss"], expected["final_val_loss"])
    assert losses(run) == losses(reference)
    if exact:
        got, want = final_weights(run), final_weights(reference)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    for folder in ckpt.list_checkpoints(run):
        assert ckpt.verify_checkpoint(folder) is True, folder
    assert not list(ckpt.checkpoint_dir(run).glob(".tmp_step_*")), listing(run)


def assert_intact(folder: Path) -> None:
    """A complete checkpoint whose every file matches its manifest."""
    assert (folder / ckpt.MARKER).is_file(), folder
    assert ckpt.verify_checkpoint(folder) is True, folder


# ------------------------------------------------------------------ faults


def flip(path: Path, at: int | None = None) -> None:
    """One bit flipped (in the middle of the file unless `at` is given)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    """The second half of the file lost."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {"flip": flip, "truncate": truncate}
REASON = {"flip": "checksum mismatch", "truncate": "truncated to"}


class Crash(Exception):
    """Stands in for the process dying between two steps (raised from a callback)."""


def crash_after(step: int):
    """A `train` callback that ends the run once `step` is logged, before anything else happens at it."""

    def callback(row: dict) -> None:
        if row["step"] == step:
            raise Crash(f"crashed after step {step}")

    return callback


def enospc(what: str = "") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), what or None)


class FailingFile:
    """A file object whose writes fail as they do on a full disk."""

    def __init__(self, file, name: str):
        self.file, self.name = file, name

    def write(self, data):
        raise enospc(self.name)

    def __getattr__(self, attr):
        return getattr(self.file, attr)


# ------------------------------------------------------------------ running


def cli(args, capsys) -> tuple[int, str, list[str]]:
    """`ropelab ARGS` in this process: (exit code, stdout, stderr lines)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_one_line(lines: list[str], *parts) -> str:
    """stderr is one line, holding every one of `parts`, and no traceback."""
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0], lines
    for part in parts:
        assert str(part) in lines[0], lines
    return lines[0]


def worker_env(extra: dict | None = None) -> dict:
    """For child processes; read when they start, so that the session's ROPELAB_CACHE reaches them."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def ropelab_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "ropelab", *(str(a) for a in args)]


def script_cmd(script: str, *args) -> list[str]:
    return [sys.executable, str(HERE / script), *(str(a) for a in args)]


def torchrun_cmd(run: Path, args, script: str | None = None) -> list[str]:
    target = [str(HERE / script)] if script else ["-m", "ropelab"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *target,
            "train", "--out", str(run), "--no-progress", *(str(a) for a in args)]
