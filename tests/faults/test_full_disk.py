"""Fault 3: a write fails with ENOSPC during a checkpoint save, a token-shard write (data preparation,
by `ropelab data prepare` and by the trainer preparing the stdlib corpus), and a metrics write: the
run stops in one line (WriteFailed: exit code 1 through the CLI), what was written before verifies,
and a run after the fault (once there is room) equals one that never met it.

The failures are monkeypatched, each raising what the library really raises on a full disk (measured
on a tmpfs: DCP wraps the OSError of its file write in a CheckpointException). `full_disk.py` then
fills a real file system (a tmpfs in a private mount namespace, where the machine allows one) right
before each write of a checkpoint save."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from ropelab.config import build_run_config
from ropelab.data import tokens
from ropelab.train import checkpoint as ckpt
from ropelab.train import integrity
from ropelab.train import lock as run_lock
from ropelab.train.loop import train
from ropelab.train.metrics import MetricsLog, read_metrics

from .helpers import (
    HERE, Crash, FailingFile, assert_intact, assert_one_line, assert_same_run, cli, crash_after, enospc,
    fault_overrides, listing, step_dir, tmp_dir, worker_env,
)

NO_ROOM = "OSError: [Errno 28] No space left on device"


def stopped_in_one_line(lines, run, newest):
    return assert_one_line(lines, f"ropelab: stopped: {run}: {NO_ROOM}",
                           f"the newest complete checkpoint is {newest}", "resume with --resume")


# ------------------------------------------------------------------ during a checkpoint save


def fail_in_save(monkeypatch, run, stage):
    """Make one write of the step-6 save fail with ENOSPC; returns the list a fired fault appends to."""
    fired = []

    def failing(original, when):
        def wrapper(*args, **kwargs):
            if tmp_dir(run, 6).is_dir() and when():
                fired.append(stage)
                raise enospc(stage)
            return original(*args, **kwargs)

        return wrapper

    always = lambda: True  # noqa: E731
    if stage == "dcp shard":  # the file write inside DCP's FileSystemWriter
        monkeypatch.setattr(dcp_filesystem, "_write_item", failing(dcp_filesystem._write_item, always))
    elif stage == "model.safetensors":
        monkeypatch.setattr(ckpt, "save_file", failing(ckpt.save_file, always))
    elif stage == "state.pt":  # the first torch.save once model.safetensors is written
        monkeypatch.setattr(ckpt.torch, "save", failing(ckpt.torch.save,
                                                        lambda: (tmp_dir(run, 6) / ckpt.WEIGHTS).is_file()))
    elif stage == "CHECKSUMS.json":
        monkeypatch.setattr(integrity, "write_manifest", failing(integrity.write_manifest, always))
    return fired


@pytest.mark.parametrize("stage", ["dcp shard", "model.safetensors", "state.pt", "CHECKSUMS.json"])
def test_full_disk_while_saving_a_checkpoint(tmp_path, tiny_overrides, reference, capsys, stage):
    run = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        fired = fail_in_save(patch, run, stage)
        code, _, lines = cli(["train", "--out", run, *fault_overrides(tiny_overrides)], capsys)
    assert fired == [stage]
    assert code == 1
    stopped_in_one_line(lines, run, step_dir(run, 4))
    assert listing(run) == [".tmp_step_00000006", "step_00000002", "step_00000004"]  # never loaded, cleared on resume
    assert_intact(step_dir(run, 4))
    assert ckpt.latest_intact_checkpoint(run) == (step_dir(run, 4), [])
    code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 0 and lines == []
    assert_same_run(run, reference)


# ------------------------------------------------------------------ during a metrics write


def test_full_disk_while_writing_metrics(tmp_path, tiny_overrides, reference, capsys, monkeypatch):
    run = tmp_path / "run"
    write = MetricsLog.write

    def failing(self, row):
        if row["step"] == 5:
            raise enospc(str(self.path))
        return write(self, row)

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLog, "write", failing)
        code, _, lines = cli(["train", "--out", run, *fault_overrides(tiny_overrides)], capsys)
    assert code == 1
    stopped_in_one_line(lines, run, step_dir(run, 4))
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert listing(run) == ["step_00000002", "step_00000004"]
    assert_intact(step_dir(run, 4))
    code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 0 and lines == []
    assert_same_run(run, reference)


# ------------------------------------------------------------------ a resume while the disk is still full


def test_resume_on_a_still_full_disk_stops_in_one_line(tmp_path, tiny_overrides, reference, capsys, monkeypatch):
    run = tmp_path / "run"
    with pytest.raises(Crash):
        train(build_run_config(overrides=fault_overrides(tiny_overrides)), run, callbacks=(crash_after(7),))

    def pwrite(fd, data, offset):  # the first write of a resume: the lock file's holder record
        raise enospc()

    with monkeypatch.context() as patch:
        patch.setattr(run_lock.os, "pwrite", pwrite)
        code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 1
    stopped_in_one_line(lines, run, step_dir(run, 6))
    assert run_lock.is_locked(run) is None  # not left held by this process
    assert listing(run) == ["step_00000004", "step_00000006"]
    assert_intact(step_dir(run, 6))
    code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 0 and lines == []
    assert_same_run(run, reference)


# ------------------------------------------------------------------ during a token-shard write


def fail_shard_writes(monkeypatch, shard: str) -> list:
    """The file write of token shard `shard` (e.g. "train-00000") fails with ENOSPC."""
    start, fired = tokens.ShardWriter._start, []

    def failing_start(self):
        start(self)
        if self.name == shard:
            fired.append(shard)
            self._file = FailingFile(self._file, str(self._tmp))

    monkeypatch.setattr(tokens.ShardWriter, "_start", failing_start)
    return fired


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


PREPARE = ["--source", "stdlib", "--tokenizer", "bytes", "--max-documents", "60", "--shard-tokens", "150000",
           "--val-percent", "10", "--workers", "1", "--no-progress"]


def test_full_disk_in_data_prepare_resumes_to_the_same_bytes(tmp_path, capsys, monkeypatch):
    reference = tmp_path / "reference"
    code, _, _ = cli(["data", "prepare", *PREPARE, "--out", reference], capsys)
    assert code == 0
    assert len(json.loads((reference / "manifest.json").read_text())["splits"]["train"]["shards"]) >= 4
    out = tmp_path / "tokens"
    with monkeypatch.context() as patch:
        fired = fail_shard_writes(patch, "train-00002")
        code, _, lines = cli(["data", "prepare", *PREPARE, "--out", out], capsys)
    assert fired == ["train-00002"] and code == 1
    assert_one_line(lines, "ropelab: ", str(out), NO_ROOM)
    progress = json.loads((out / "progress.json").read_text())
    assert [s["name"] for s in progress["splits"]["train"]] == ["train-00000", "train-00001"]  # kept
    assert not (out / "manifest.json").exists()  # not usable as data until complete
    code, _, lines = cli(["data", "prepare", *PREPARE, "--out", out], capsys)  # the same command, with room
    assert code == 0 and lines == []
    assert shard_bytes(out) == shard_bytes(reference)


def test_full_disk_while_the_trainer_prepares_tokens(tmp_path, tiny_overrides, reference, capsys, monkeypatch,
                                                     ropelab_cache):
    run = tmp_path / "run"
    with pytest.raises(Crash):
        train(build_run_config(overrides=fault_overrides(tiny_overrides)), run, callbacks=(crash_after(7),))
    # the resume meets an empty token cache (another machine, a cleared cache) and a full disk
    cache = tmp_path / "cache"
    shutil.copytree(os.path.join(ropelab_cache, "kernels"), cache / "kernels")
    monkeypatch.setenv("ROPELAB_CACHE", str(cache))
    with monkeypatch.context() as patch:
        fired = fail_shard_writes(patch, "train-00000")
        code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert fired == ["train-00000"] and code == 1
    assert_one_line(lines, "ropelab: stopped: ", str(cache / "tokens"), NO_ROOM)
    assert listing(run) == ["step_00000004", "step_00000006"]
    assert_intact(step_dir(run, 4))
    assert_intact(step_dir(run, 6))
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 8))  # untouched until the resume starts
    code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 0 and lines == []
    assert_same_run(run, reference)
    (prepared,) = (cache / "tokens").iterdir()  # the same bytes as the session's copy of that folder
    assert shard_bytes(prepared) == shard_bytes(Path(ropelab_cache) / "tokens" / prepared.name)


# ------------------------------------------------------------------ a real full disk


def can_mount_tmpfs(where) -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs -o size=64k ropelab-probe {where}"], capture_output=True)
    return probe.returncode == 0


def test_a_real_full_disk_during_each_write_of_a_save(tmp_path, tiny_overrides, reference):
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    if not can_mount_tmpfs(disk):
        pytest.skip("needs a tmpfs mounted in a private mount namespace (unshare --mount: root or CAP_SYS_ADMIN)")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=24m ropelab-full-disk "$FULL_DISK" && exec "$0" "$@"',
           sys.executable, str(HERE / "full_disk.py"), *fault_overrides(tiny_overrides)]
    done = subprocess.run(cmd, capture_output=True, env=worker_env({"FULL_DISK": str(disk), "FULL_DISK_OUT": str(out)}),
                          timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads((out / "report.json").read_text())
    problems = []
    for stage, seen in report.items():
        run = disk / stage

        def stopped(code, lines):
            line = lines[0] if len(lines) == 1 else ""
            return code == 1 and line.startswith(f"ropelab: stopped: {run}: {NO_ROOM}") and line.endswith(
                f"; the newest complete checkpoint is {step_dir(run, 4)}; resume with --resume once there is room")

        ok = (stopped(seen["code"], seen["stderr"]) and seen["intact"]
              and stopped(seen["still_full"], seen["still_full_stderr"]) and seen["resumed"] == 0)
        if not ok:
            problems.append(f"{stage}: {seen}")
    assert not problems, "\n".join(problems)
    for stage in report:
        assert_same_run(out / stage, reference)
