"""The checks of a command's --out folder and of folder names taken from configs."""

import errno
import fcntl
import os
import subprocess

import pytest

from ropelab import files
from ropelab.config import ConfigError
from ropelab.errors import WriteFailed
from ropelab.files import as_os_error, check_folder_name, new_folder, output_folder, refuse_existing, writable_folder

OWN = ("result.json", "logs", "checkpoints/.tmp_*")


def test_a_new_or_empty_folder_or_one_holding_only_own_entries_is_taken(tmp_path):
    assert output_folder(tmp_path / "new" / "deeper", "w", OWN) == tmp_path / "new" / "deeper"
    (tmp_path / "out" / "checkpoints" / ".tmp_1").mkdir(parents=True)
    (tmp_path / "out" / "logs").mkdir()
    (tmp_path / "out" / "logs" / "anything").write_text("")
    (tmp_path / "out" / "result.json").write_text("{}")
    assert output_folder(tmp_path / "out", "w", OWN) == tmp_path / "out"


@pytest.mark.parametrize("entry, named", [("notes.txt", "notes.txt"), ("checkpoints/step_1", "checkpoints/step_1"),
                                          ("result.json.bak", "result.json.bak")])
def test_a_folder_holding_anything_else_is_refused(tmp_path, entry, named):
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / entry).write_text("")
    with pytest.raises(ConfigError, match=f"^{tmp_path}: holds {named}, which w did not write; choose a new or empty"):
        output_folder(tmp_path, "w", OWN)
    output_folder(tmp_path, "w", own=None)  # the writer checks the contents itself


def test_empty_text_and_files_are_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="^--out '': empty; give the folder w writes into$"):
        output_folder("", "w")
    with pytest.raises(ConfigError, match=f"^{tmp_path}/f: is not a folder"):
        output_folder(tmp_path / "f", "w", own=None)
    with pytest.raises(ConfigError, match=f"^{tmp_path}/f/a/b: goes through {tmp_path}/f, which is not a folder"):
        output_folder(tmp_path / "f" / "a" / "b", "w")


def test_refuse_existing_takes_only_new_or_empty_folders(tmp_path):
    assert refuse_existing(tmp_path) == tmp_path
    (tmp_path / "x").write_text("")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        refuse_existing(tmp_path)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", ".hidden", "", "a b", "/abs"])
def test_folder_names_are_one_plain_component(name):
    with pytest.raises(ConfigError, match="^variants\\[0\\].name=.*: names a folder"):
        check_folder_name(name, "variants[0].name")


def test_plain_folder_names_pass():
    assert check_folder_name("nope-seed1.5_x+y", "k") == "nope-seed1.5_x+y"


def test_folder_names_are_at_most_100_characters_and_quoted_short():
    """Before: a 300-character variant name passed, and the run's folder failed with ENAMETOOLONG."""
    assert check_folder_name("v" * 100, "k") == "v" * 100
    with pytest.raises(ConfigError) as err:
        check_folder_name("v" * 300, "variants[0]: run id")
    message = str(err.value)
    assert message.endswith(": names a folder, so it may be at most 100 characters long, not 300") and len(message) < 300


def test_new_folder_removes_only_the_temporary_folders_of_killed_calls(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    abandoned = tmp_path / f".tmp_model_{gone.pid}"  # a call killed while building it
    other_host = tmp_path / f".tmp_shared_{gone.pid}"  # a live call of another host: its pid means nothing here
    unlocked = tmp_path / f".tmp_probe_{os.getpid()}"  # a live process's, built without the lock
    kept = [other_host, unlocked, tmp_path / ".tmp_step_00000006", tmp_path / ".tmp_notes"]
    for folder in (abandoned, *kept):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    held = os.open(other_host, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with new_folder(tmp_path / "out") as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(p.name for p in kept)])


def test_a_writable_folder_is_checked_without_leaving_anything(tmp_path):
    assert writable_folder(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert list(tmp_path.iterdir()) == []  # the folders made for the check are removed again
    (tmp_path / "mine").mkdir()
    writable_folder(tmp_path / "mine")
    assert list(tmp_path.iterdir()) == [tmp_path / "mine"] and list((tmp_path / "mine").iterdir()) == []


@pytest.mark.parametrize("error, raised", [(errno.EROFS, WriteFailed), (errno.ENOSPC, WriteFailed),
                                           (errno.EACCES, ConfigError)])
def test_an_unwritable_folder_is_one_line(tmp_path, monkeypatch, error, raised):
    def mkstemp(**kwargs):
        raise OSError(error, os.strerror(error), kwargs["dir"])

    monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)
    with pytest.raises(raised) as caught:
        writable_folder(tmp_path / "out")
    assert str(caught.value) == (f"{tmp_path / 'out'}: cannot write there ({os.strerror(error)}); stopped before any "
                                 "work, nothing was written")
    assert list(tmp_path.iterdir()) == []


class Failures(BaseException):
    """Like DCP's CheckpointException: a BaseException holding each rank's (exception, traceback)."""

    def __init__(self, error):
        self.failures = {0: (error, "traceback")}


@pytest.mark.parametrize("raised, expected", [
    (Failures(OSError(errno.ENOSPC, "No space left on device")), errno.ENOSPC),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    # torch's zip writer says no more than this; a write into the folder now succeeds, so: EIO
    (Failures(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")), errno.EIO),
])
def test_a_failed_write_is_raised_as_the_os_error_behind_it(tmp_path, raised, expected):
    with pytest.raises(OSError) as caught, as_os_error(tmp_path):
        raise raised
    assert caught.value.errno == expected and caught.value.__cause__ is raised


def test_the_zip_writers_failure_takes_the_errno_a_write_meets_now(tmp_path, monkeypatch):
    def full(**kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.tempfile, "mkstemp", full)
    with pytest.raises(OSError) as caught, as_os_error(tmp_path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path)


@pytest.mark.parametrize("raised", [RuntimeError("something else"), KeyboardInterrupt(), ValueError("x"),
                                    Failures(RuntimeError("something else"))])
def test_other_failures_pass_unchanged(tmp_path, raised):
    with pytest.raises(type(raised)) as caught, as_os_error(tmp_path):
        raise raised
    assert caught.value is raised
