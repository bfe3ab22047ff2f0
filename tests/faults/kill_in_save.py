"""`ropelab ARGS`, SIGKILLed at one stage ($CRASH_STAGE) of writing the checkpoint of step
$CRASH_STEP into $CRASH_RUN:
  shards     after dcp/ (the shards and .metadata) is written
  weights    after model.safetensors
  state      after state.pt, before the checksums are gathered
  manifest   after CHECKSUMS.json, before the COMPLETE marker
  rename     after the COMPLETE marker, before the folder is renamed into place
  prune      in checkpoint.prune, after its first rmtree (the new checkpoint is in place)
  mid_prune  in checkpoint.prune, half-way through its first rmtree (the old folder's dcp/ is gone, its
             COMPLETE marker is not)
Under torchrun only rank $CRASH_RANK (default: every rank) dies. Not a test module:
test_kill_during_save.py and test_torchrun.py launch it."""

import os
import shutil
import signal
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

from ropelab import cli
from ropelab.train import checkpoint, integrity

run = Path(os.environ["CRASH_RUN"])
step = int(os.environ["CRASH_STEP"])
stage = os.environ["CRASH_STAGE"]
rank = os.environ.get("CRASH_RANK")
partial = run / "checkpoints" / f".tmp_step_{step:08d}"
final = run / "checkpoints" / f"step_{step:08d}"


def die() -> None:
    if rank is None or os.environ.get("RANK", "0") == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def saving(*_, **__) -> bool:
    return partial.is_dir()


def after(module, name, when=saving):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(*args, **kwargs):
            die()
        return result

    setattr(module, name, wrapper)


def before(module, name, when=saving):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            die()
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


if stage == "shards":
    after(dcp, "save")
elif stage == "weights":
    after(checkpoint, "save_file")
elif stage == "state":
    before(checkpoint, "_gather_checksums")
elif stage == "manifest":
    after(integrity, "write_manifest")
elif stage == "rename":
    before(os, "replace", lambda src, dst, **_: Path(src) == partial)
elif stage in ("prune", "mid_prune"):
    pruning = []
    prune, rmtree = checkpoint.prune, shutil.rmtree

    def prune_then_die(*args, **kwargs):
        pruning.append(final.is_dir())
        try:
            return prune(*args, **kwargs)
        finally:
            pruning.pop()

    def rmtree_in_prune(path, *args, **kwargs):
        if not (pruning and pruning[-1]):
            return rmtree(path, *args, **kwargs)
        if stage == "mid_prune":
            rmtree(Path(path) / "dcp")
        else:
            rmtree(path, *args, **kwargs)
        die()

    checkpoint.prune = prune_then_die
    shutil.rmtree = rmtree_in_prune
else:
    raise SystemExit(f"CRASH_STAGE={stage!r}: unknown")

sys.exit(cli.main(sys.argv[1:]))
