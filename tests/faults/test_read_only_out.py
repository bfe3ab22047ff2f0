"""Fault: every writing command meets an --out it cannot write (a read-only file system, a full disk):
it stops in one line before its work (exit 1), with no traceback and nothing written; a folder the user
may not write into (no permission) is a user's mistake (exit 2).

Tests may run as root, whom chmod does not stop, so the read-only file system is a monkeypatch: under
``ro/`` every folder made and every file opened for writing fails with EROFS, as on a real one (os.mkdir,
os.open, and open() from Python code). Before the fix every command but fit (which refused its input
first) escaped with an OSError traceback at its first write, eval longctx and extrapolation after all
their work."""

import builtins
import errno
import io
import os
import stat
from pathlib import Path

import pytest

from ropelab.export.hf import export_hf

from .helpers import assert_one_line, cli

READ_ONLY = "Read-only file system"


@pytest.fixture(scope="module")
def hf_folder(run, tmp_path_factory):
    """The session's tiny run exported as a Hugging Face folder (read-only): what `ropelab import` reads."""
    out = tmp_path_factory.mktemp("hf") / "model"
    export_hf(run, out)
    return out


@pytest.fixture
def study(run, tmp_path):
    """A study folder holding one finished run (the session's, linked)."""
    (tmp_path / "study" / "runs").mkdir(parents=True)
    (tmp_path / "study" / "runs" / "r0").symlink_to(run)
    return tmp_path / "study"


def refusing_writes_under(monkeypatch, root: Path, error: int) -> None:
    """Make every folder made and every file opened for writing under `root` fail with `error`."""

    def under(path) -> bool:
        return not isinstance(path, int) and Path(os.path.abspath(os.fsdecode(path))).is_relative_to(root)

    def refuse(path):
        raise OSError(error, os.strerror(error), os.fsdecode(path))

    mkdir, os_open, py_open = os.mkdir, os.open, io.open

    def guarded_mkdir(path, *args, **kwargs):
        if under(path):
            refuse(path)
        return mkdir(path, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            refuse(path)
        return os_open(path, flags, *args, **kwargs)

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and under(file):
            refuse(file)
        return py_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", guarded_mkdir)
    monkeypatch.setattr(os, "open", guarded_os_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(builtins, "open", guarded_open)


# (command, its arguments before --out: RUN, HF, STUDY and CKPT stand for the fixtures' folders)
COMMANDS = {
    "export": ["export", "RUN"],
    "import": ["import", "HF"],
    "study": ["study", "--no-live"],
    "report": ["report", "STUDY"],
    "fit": ["fit", "STUDY"],
    "claims": ["claims", "--only", "rq1", "--no-live"],
    "data prepare": ["data", "prepare", "--source", "stdlib", "--tokenizer", "bytes", "--max-documents", "20",
                     "--workers", "1", "--no-progress"],
    "eval lm": ["eval", "lm", "RUN", "--tasks", "python_ppl", "--include-path", "configs/eval", "--limit", "2"],
    "eval longctx": ["eval", "longctx", "RUN", "--lengths", "128", "--depths", "0.5", "--items", "1", "--no-progress"],
    "eval extrapolation": ["eval", "extrapolation", "RUN", "--lengths", "32,64", "--methods", "none", "--no-passkey",
                           "--no-progress"],
    "probe run": ["probe", "run", "CKPT", "--block-len", "8", "--repeats", "2", "--no-progress"],
    "probe weights": ["probe", "weights", "CKPT", "CKPT"],
    "memory": ["memory", "--presets", "tiny-llama"],
    "convert": ["convert", "RUN", "rope.keep_pairs=2", "rope.select=high"],
}


def command_line(name, run, hf_folder, study, out) -> list:
    folders = {"RUN": run, "HF": hf_folder, "STUDY": study, "CKPT": run / "checkpoints" / "step_00000003"}
    return [folders.get(a, a) for a in COMMANDS[name]] + ["--out", out]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_read_only_out_stops_every_command_in_one_line_before_its_work(name, run, hf_folder, study, tmp_path,
                                                                       capsys, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    out = read_only / "out"
    monkeypatch.chdir(Path(__file__).parents[2])  # configs/ are the repository's
    refusing_writes_under(monkeypatch, read_only, errno.EROFS)
    code, stdout, lines = cli(command_line(name, run, hf_folder, study, out), capsys)
    assert code == 1, (stdout, lines)
    assert_one_line(lines, f"ropelab: stopped: {out}: cannot write there ({READ_ONLY}); stopped before any work, "
                           "nothing was written")
    assert stdout == ""  # nothing computed, nothing printed
    assert list(read_only.iterdir()) == []


@pytest.mark.parametrize("name", ["export", "eval longctx", "data prepare"])
def test_a_full_disk_at_out_stops_in_one_line_before_the_work(name, run, hf_folder, study, tmp_path, capsys,
                                                              monkeypatch):
    out = tmp_path / "full" / "out"
    monkeypatch.chdir(Path(__file__).parents[2])
    refusing_writes_under(monkeypatch, tmp_path / "full", errno.ENOSPC)
    code, stdout, lines = cli(command_line(name, run, hf_folder, study, out), capsys)
    assert code == 1 and stdout == ""
    assert_one_line(lines, f"ropelab: stopped: {out}: cannot write there (No space left on device)")


def test_a_disk_filling_up_during_the_export_stops_it_in_one_line(run, tmp_path, capsys, monkeypatch):
    """The check passes, then the weights do not fit: safetensors reports it as a SafetensorError naming the
    OS error (measured on a 200 KiB tmpfs), which used to escape as a traceback."""
    import safetensors
    import transformers.modeling_utils

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    code, stdout, lines = cli(["export", run, "--out", tmp_path / "hf"], capsys)
    ours = [line for line in lines if "ropelab" in line or "Traceback" in line]  # not transformers' progress bar
    assert code == 1 and stdout == ""
    assert_one_line(ours, "ropelab: stopped: OSError: [Errno 28] No space left on device: ", str(tmp_path / ".tmp_hf_"))
    assert list(tmp_path.iterdir()) == []  # the half-built folder removed, no hf/


def test_an_out_without_write_permission_is_a_users_mistake(run, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(locked, os.W_OK):  # root: chmod does not stop it
        refusing_writes_under(monkeypatch, locked, errno.EACCES)
    code, stdout, lines = cli(["export", run, "--out", locked / "hf"], capsys)
    assert code == 2 and stdout == ""
    assert_one_line(lines, f"ropelab: error: {locked / 'hf'}: cannot write there (Permission denied)")
