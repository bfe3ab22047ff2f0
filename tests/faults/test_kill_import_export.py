"""`ropelab import` / `ropelab export` killed while they build their folder (issue #52): the temporary
sibling (`.tmp_<name>_<pid>`) they leave is removed by the next import or export into the same parent,
and the one of a call still building is not."""

import subprocess

import pytest

from ropelab.export.hf import export_hf

from .helpers import cli, script_cmd, worker_env


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The session's tiny run as a Hugging Face folder (read-only): what `ropelab import` reads."""
    out = tmp_path_factory.mktemp("exported") / "hf"
    export_hf(run, out)
    return out


def temporary(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".tmp_"))


@pytest.mark.parametrize("command", ["export", "import"])
def test_what_a_killed_import_or_export_left_is_removed_by_the_next_one(run, exported, tmp_path, capsys, command):
    source = run if command == "export" else exported
    parent = tmp_path / "models"
    live = subprocess.Popen(script_cmd("stop_in_new_folder.py", command, source, "--out", parent / "live"),
                            stdout=subprocess.PIPE, text=True, env=worker_env({"NEW_FOLDER": "hold"}))
    try:
        assert live.stdout.readline() == "holding\n"
        killed = subprocess.Popen(script_cmd("stop_in_new_folder.py", command, source, "--out", parent / "out"),
                                  env=worker_env({"NEW_FOLDER": "kill"}))
        assert killed.wait(timeout=300) == -9
        assert temporary(parent) == sorted([f".tmp_live_{live.pid}", f".tmp_out_{killed.pid}"])
        code, _, err = cli([command, source, "--out", parent / "out"], capsys)
        assert code == 0, err
        assert temporary(parent) == [f".tmp_live_{live.pid}"]  # before: .tmp_out_<pid> was left for good
        assert (parent / "out" / "config.json" if command == "export" else parent / "out" / "config.yaml").is_file()
    finally:
        live.kill()
        live.wait()
