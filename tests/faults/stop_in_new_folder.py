"""`ropelab ARGS` (import or export) stopped inside `new_folder`, once its temporary folder holds a file:
with $NEW_FOLDER=kill it SIGKILLs itself there (as a SIGKILL, or a SIGTERM, from outside would end it),
with $NEW_FOLDER=hold it prints "holding" and waits there to be killed (a call still building its folder).
Not a test module: test_kill_import_export.py launches it."""

import os
import signal
import sys
import time
from contextlib import contextmanager

from ropelab import cli, files
from ropelab.export import hf
from ropelab.sources import imported

building = files.new_folder


@contextmanager
def stopped_inside(out_dir):
    with building(out_dir) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half of a folder")
        if os.environ["NEW_FOLDER"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("holding", flush=True)
        time.sleep(600)
        yield tmp


hf.new_folder = imported.new_folder = stopped_inside
sys.exit(cli.main(sys.argv[1:]))
