"""`ropelab ARGS`, SIGKILLed (or sent $CRASH_SIGNAL, e.g. TERM) at one stage ($CRASH_STAGE) of writing
the checkpoint of step $CRASH_STEP into $CRASH_RUN:
  shards     after dcp/ (the shards and .metadata) is written
  weights    after model.safetensors
  state      after state.pt, before the checksums are gathered
  manifest   after CHECKSUMS.json, before the COMPLETE marker
  rename     after the COMPLETE marker, before the folder is renamed into place
  prune      in checkpoint.prune, after its first rmtree (the new checkpoint is in place)
  mid_prune  in checkpoint.prune, half-way through its first rmtree (the old folder's dcp/ is gone, its
             COMPLETE marker is not)
Under torchrun only rank $CRASH_RANK (default: every rank) dies.

Independently, with $STOP_AFTER_STEP=N, $STOP_SIGNAL (TERM, USR1, ...) is sent once step N is computed
(N=0: while the trainer sets up, after building its data loaders), by rank $STOP_RANK (default:
every rank) to itself; with $STOP_PARENT=1 to its parent instead (torchrun's agent, which forwards
it to every rank), then this rank waits 2 s for the forwarded signal. Not a test module:
test_kill_during_save.py, test_stop_signals.py and test_torchrun.py launch it."""

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from ropelab import cli
from ropelab.train import checkpoint, integrity, loop

run = Path(os.environ.get("CRASH_RUN", "."))
step = int(os.environ.get("CRASH_STEP", "0"))
stage = os.environ.get("CRASH_STAGE")
rank = os.environ.get("CRASH_RANK")
crash_signal = signal.Signals["SIG" + os.environ.get("CRASH_SIGNAL", "KILL")]
partial = run / "checkpoints" / f".tmp_step_{step:08d}"
final = run / "checkpoints" / f"step_{step:08d}"
this_rank = os.environ.get("RANK", "0")


def die() -> None:
    if rank is None or this_rank == rank:
        os.kill(os.getpid(), crash_signal)


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


if stage is None:
    pass
elif stage == "shards":
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


def stop_after(module, name: str, calls: int) -> None:
    """Send the stop signal once `module.name` has returned for the `calls`-th time."""
    original, done = getattr(module, name), []

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        done.append(1)
        if len(done) == calls and os.environ.get("STOP_RANK", this_rank) == this_rank:
            stop_signal = signal.Signals["SIG" + os.environ.get("STOP_SIGNAL", "TERM")]
            if os.environ.get("STOP_PARENT"):
                os.kill(os.getppid(), stop_signal)
                time.sleep(2)
            else:
                os.kill(os.getpid(), stop_signal)
        return result

    setattr(module, name, wrapper)


stop_step = int(os.environ.get("STOP_AFTER_STEP", "-1"))
if stop_step == 0:
    stop_after(loop, "build_loaders", 1)
elif stop_step > 0:
    stop_after(loop, "clip_grad_norm", stop_step)  # called once per step, after its gradients

sys.exit(cli.main(sys.argv[1:]))
