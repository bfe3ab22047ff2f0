"""`ropelab train` under torchrun, with every rank SIGKILLed in the middle of writing the checkpoint
of step $CRASH_STEP: after the sharded state is on disk, before the COMPLETE marker and rename.
Not a test module; tests/train/test_distributed.py launches it."""

import os
import signal
import sys
from pathlib import Path

from ropelab import cli
from ropelab.train import checkpoint

partial = Path(os.environ["CRASH_RUN"]) / "checkpoints" / f".tmp_step_{int(os.environ['CRASH_STEP']):08d}"
full_weights = checkpoint._full_weights


def crash_while_saving(model):
    if partial.exists():
        os.kill(os.getpid(), signal.SIGKILL)
    return full_weights(model)


checkpoint._full_weights = crash_while_saving
sys.exit(cli.main(sys.argv[1:]))
