"""Fault 4: two trainers started on the same run directory at once (`python -m ropelab train --out
DIR ...` twice, together): one trains, the other stops in one line naming the holder."""

import subprocess

from .helpers import assert_same_run, fault_overrides, ropelab_cmd, worker_env


def test_two_trainers_on_one_directory(tmp_path, tiny_overrides, reference):
    run = tmp_path / "run"
    cmd = ropelab_cmd("train", "--out", run, *fault_overrides(tiny_overrides))
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=worker_env()) for _ in range(2)]
    done = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in done)
    assert codes == [0, 2], [(p.returncode, err.decode()[-2000:]) for p, _, err in done]
    (winner, out, _), = [d for d in done if d[0].returncode == 0]
    (loser, _, err), = [d for d in done if d[0].returncode == 2]
    assert out.decode().startswith("done: 8 steps")
    lines = err.decode().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"ropelab: error: {run}: another trainer is running in it (pid {winner.pid} on "), lines
    assert_same_run(run, reference)
