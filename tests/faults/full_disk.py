"""A real full disk during each write of a checkpoint save. Run by test_full_disk.py as
``unshare --mount sh -c 'mount -t tmpfs ... $FULL_DISK && exec python full_disk.py OVERRIDES'``: the
tmpfs at $FULL_DISK exists only for this process. For each stage below, `ropelab train --out
$FULL_DISK/<stage> OVERRIDES` runs until the save of step 6, where the tmpfs is filled to its last
byte right before that stage's write; then the filler is deleted and the run resumed; the finished
run is copied to $FULL_DISK_OUT/<stage> and what happened to $FULL_DISK_OUT/report.json. Before
the room is made, a first resume meets the disk still full.
  shards    before dcp.save (the shard writes)         rng       before rng_rank0.pt
  shards-partway  before dcp.save, 64 KiB left: torch's zip writer fills the disk in the middle of a shard
  weights   before model.safetensors                   state     before state.pt (after model.safetensors)
  manifest  before CHECKSUMS.json                      marker    before COMPLETE (after CHECKSUMS.json)
Not a test module."""

import contextlib
import errno
import io
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch.distributed.checkpoint as dcp

from ropelab import cli
from ropelab.train import checkpoint, integrity

disk, out = Path(os.environ["FULL_DISK"]), Path(os.environ["FULL_DISK_OUT"])
filler = disk / "filler"
current = {"run": None, "stage": None}


def fill(leave: int = 0) -> None:
    """Write zeros until the file system has no byte left, then give `leave` bytes back."""
    with open(filler, "ab", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while f.write(b"\0" * size):
                    pass
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        f.truncate(f.tell() - leave)


def saving(stage: str) -> bool:
    return current["stage"] == stage and (current["run"] / "checkpoints" / ".tmp_step_00000006").is_dir()


def fill_around(module, name, before=None, after=None, leave=0):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        if before and saving(before):
            fill(leave)
        result = original(*args, **kwargs)
        if after and saving(after):
            fill()
        return result

    setattr(module, name, wrapper)


fill_around(dcp, "save", before="shards")
fill_around(dcp, "save", before="shards-partway", leave=64 << 10)
fill_around(checkpoint, "rng_state", before="rng")  # called right before its file is written
fill_around(checkpoint, "save_file", before="weights", after="state")
fill_around(integrity, "write_manifest", before="manifest", after="marker")


def ropelab(*args) -> tuple[object, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except BaseException as exc:  # what escapes the CLI (a traceback for the user)
            code = f"escaped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            traceback.print_exc()
    return code, err.getvalue().splitlines()


report = {}
for stage in ("shards", "shards-partway", "rng", "weights", "state", "manifest", "marker"):
    run = disk / stage
    current.update(run=run, stage=stage)
    code, lines = ropelab("train", "--out", run, *sys.argv[1:])
    current["stage"] = None
    latest = checkpoint.latest_checkpoint(run)
    try:
        intact = latest is not None and checkpoint.verify_checkpoint(latest) is True
    except checkpoint.DamagedCheckpoint:
        intact = False
    still_full, still_full_lines = ropelab("train", "--out", run, "--resume")  # before any room is made
    if filler.exists():
        filler.unlink()
    resumed, resume_lines = ropelab("train", "--out", run, "--resume")
    report[stage] = {"code": code, "stderr": lines[-20:], "latest": str(latest), "intact": intact,
                     "still_full": still_full, "still_full_stderr": still_full_lines[-20:],
                     "resumed": resumed, "resume_stderr": resume_lines[-20:]}
    shutil.copytree(run, out / stage)
    shutil.rmtree(run)
(out / "report.json").write_text(json.dumps(report, indent=1))
