"""Files and folders that readers see whole.

  write_atomically(path, data)  written under a temporary name in the same folder, then renamed into
                                place, so a crash or a concurrent reader meets the old file or the
                                new one, never half of one
  new_folder(out_dir)           a folder built under a temporary sibling name and renamed into place
                                when complete; refuses an `out_dir` that exists and is not empty; removes
                                the temporary siblings that killed calls left
  output_folder(out_dir, ...)   the check every writing command makes of its --out before it writes:
                                not empty text, not a file, and no entry the command did not write
  writable_folder(folder)       proven writable by a file written and removed again (nothing left behind):
                                every writing command's check before its work, so that a read-only or
                                full file system stops it in one line instead of at its first write
  as_os_error(folder)           a failed write in the block raised as the OSError behind it, however the
                                writing library reported it
  check_folder_name(name, key)  a name from a config or the command line that names a folder inside
                                --out (a study's run id): one path component, never ``..``, at most 100
                                characters
  refuse_links_out(folder, ...) a one-line ConfigError for a link in `folder` leading out of it, before a
                                command that writes and prunes there follows it into someone else's files
  one_at_a_time(lock_file)      an exclusive flock held for a block: a second process waits for the
                                first, so a cache entry is built once by whichever process comes first
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import re
import shutil
import tempfile
from contextlib import contextmanager, suppress
from itertools import takewhile
from pathlib import Path
from typing import Iterable, Iterator, Optional

from ropelab.config import ConfigError
from ropelab.errors import WriteFailed, is_storage_error, quoted


@contextmanager
def one_at_a_time(lock_file: Path) -> Iterator[None]:
    """An exclusive flock on `lock_file` (made if absent, never deleted: deleting it would let two processes
    lock two files of one name) for the block. The kernel drops it when its holder dies, however it dies."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_atomically(path: Path, data: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


def output_folder(out_dir: str | Path, writer: str, own: Optional[Iterable[str]] = ()) -> Path:
    """`out_dir` as a Path that `writer` (a command, e.g. "ropelab train") may write into, or a one-line
    ConfigError before anything is written: for empty text, for a file (or a path through one), and
    for a folder holding an entry that no pattern of `own` matches. `own` lists, as glob patterns of
    names, what `writer` itself writes there and may find from an earlier call (a resumed run, a
    rebuilt report); ``"dir/pattern"`` lets folder ``dir`` hold only entries matching ``pattern``.
    `own` None: the contents are the writer's own business (it checks them itself)."""
    if not str(out_dir).strip():
        raise ConfigError(f"--out {str(out_dir)!r}: empty; give the folder {writer} writes into")
    out = Path(out_dir)
    for path in (out, *out.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                where = "is not a folder" if path == out else f"goes through {path}, which is not a folder"
                raise ConfigError(f"{out}: {where}; {writer} writes a folder there (nothing was changed)")
            break
    if own is None or not out.is_dir():
        return out
    patterns = tuple(own)
    foreign = _foreign_entry(out, patterns)
    if foreign is not None and not patterns:
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out (nothing is overwritten)")
    if foreign is not None:
        raise ConfigError(f"{out}: holds {foreign}, which {writer} did not write; choose a new or empty folder "
                          "(nothing was changed)")
    return out


def _write_probe(folder: Path) -> None:
    """Write a small file in `folder` and remove it: the OSError a write there meets now, if any."""
    fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(b"ropelab write check\n")
    finally:
        os.unlink(probe)


def writable_folder(folder: str | Path) -> Path:
    """`folder` as a Path, once a file written there was removed again (the folder and its missing parents
    are made for it and removed after). A read-only, full or failing file system is a one-line WriteFailed,
    any other refusal (no permission) a one-line ConfigError: before a command's work, not at its first write."""
    folder = Path(folder)
    missing = list(takewhile(lambda path: not path.exists(), (folder, *folder.parents)))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_probe(folder)
    except OSError as exc:
        problem = f"{folder}: cannot write there ({exc.strerror}); stopped before any work, nothing was written"
        raise (WriteFailed if is_storage_error(exc) else ConfigError)(problem) from None
    finally:
        for path in missing:  # innermost first; one that meanwhile holds something is kept
            with suppress(OSError):
                path.rmdir()
    return folder


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) names the OS error behind a failed write
_ZIP_WRITE_FAILED = "unexpected pos"  # torch's zip writer (torch.save) when a write of its file fell short


def _os_error_behind(exc: BaseException, folder: Path) -> Optional[OSError]:
    """The OSError behind a failed write into `folder` reported as `exc` (naming `folder` where `exc` names
    no file), or None when `exc` is not one."""
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict):
        return next((found for error, _ in failures.values()
                     if (found := _os_error_behind(error, folder)) is not None), None)
    if not isinstance(exc, Exception):
        return None
    number = _OS_ERROR.search(str(exc))
    if number is not None:
        return OSError(int(number[1]), os.strerror(int(number[1])), str(folder))
    if isinstance(exc, RuntimeError) and _ZIP_WRITE_FAILED in str(exc):  # it drops the errno: ask the disk
        try:
            _write_probe(folder)
        except OSError as error:
            return OSError(error.errno, error.strerror, str(folder))
        return OSError(errno.EIO, f"{os.strerror(errno.EIO)} (torch's writer: {str(exc).splitlines()[0][:200]})",
                       str(folder))
    return None


@contextmanager
def as_os_error(folder: str | Path) -> Iterator[None]:
    """A failed write in the block raised as the OSError behind it, so that a full disk reaches the caller
    as ENOSPC: DCP wraps its file writes' errors in a CheckpointException (a BaseException), safetensors
    names the OS error number in a SafetensorError, and torch's zip writer raises a RuntimeError without
    one (then the error is the one a small write into `folder` meets now; EIO if none)."""
    try:
        yield
    except BaseException as exc:
        error = _os_error_behind(exc, Path(folder))
        if error is None or error is exc:
            raise
        raise error from exc


def _foreign_entry(folder: Path, patterns: tuple[str, ...], prefix: str = "") -> Optional[str]:
    """The first entry under `folder` (as ``prefix + name``) that no pattern allows, or None."""
    for entry in sorted(folder.iterdir()):
        name = prefix + entry.name
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            continue
        inner = [p for p in patterns if p.startswith(name + "/")]
        if inner and entry.is_dir() and not entry.is_symlink():
            found = _foreign_entry(entry, tuple(inner), name + "/")
            if found is None:
                continue
            return found
        return name
    return None


FOLDER_NAME_MAX = 100  # characters; file systems allow 255 bytes, and the folder's own files add to its path


def check_folder_name(name: str, key: str) -> str:
    """`name`, or a one-line ConfigError unless it is one plain folder name of at most `FOLDER_NAME_MAX`
    characters: letters, digits, ``. _ + -``, not starting with a dot (no ``..``, no ``/``: the folder
    stays inside the one it is made in)."""
    if not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*", name):
        raise ConfigError(f"{key}={quoted(name)}: names a folder, so it may hold only letters, digits and . _ + - "
                          "(not first: a dot)")
    if len(name) > FOLDER_NAME_MAX:
        raise ConfigError(f"{key}={quoted(name)}: names a folder, so it may be at most {FOLDER_NAME_MAX} characters "
                          f"long, not {len(name)}")
    return name


def refuse_links_out(folder: str | Path, writer: str) -> None:
    """A one-line ConfigError for the first symbolic link in `folder` (at any depth) leading out of it, since
    `writer` writes, prunes and resumes from what it finds there: a run's `checkpoints/` linked to another
    run's would train from that run's checkpoints and prune them. Links are never followed in the search."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    root = folder.resolve()
    for parent, dirs, files in os.walk(folder):  # a linked folder is listed in `dirs`, never entered
        for name in sorted(dirs + files):
            path = Path(parent) / name
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                raise ConfigError(f"{path}: a link to {path.resolve()}, outside {folder}; {writer} writes and prunes "
                                  "only inside its folder and follows no link out of it: replace the link with "
                                  "what it points to, or choose another --out (nothing was changed)")


def refuse_existing(out_dir: str | Path) -> Path:
    """`out_dir` as a Path, or a one-line ConfigError when it exists and is not an empty folder, or cannot be
    written (`writable_folder`)."""
    return writable_folder(output_folder(out_dir, "this command"))


# new_folder's temporary folders, ".tmp_<name>_<pid>": a Linux pid has at most 7 digits (below 2**22) and no
# leading zero, so a checkpoint being saved (".tmp_step_00000006", 8 digits) never matches
_TEMP_FOLDER = re.compile(r"\.tmp_.+_([1-9][0-9]{0,6})")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _clear_abandoned(parent: Path) -> None:
    """Remove from `parent` the temporary folders of `new_folder` calls that were killed before their rename
    (SIGKILL; SIGTERM, whose default action runs no cleanup): those of a process that is gone and that no
    process holds locked. Both, since neither alone is proof: a pid may be another host's on a shared file
    system (its process holds the lock) or reused, and `ropelab probe` builds its folder under the same name
    without a lock."""
    for entry in sorted(parent.iterdir()):
        found = _TEMP_FOLDER.fullmatch(entry.name)
        if found is None or entry.is_symlink() or not entry.is_dir() or _process_alive(int(found[1])):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:  # removed meanwhile by another caller
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(entry, ignore_errors=True)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


@contextmanager
def new_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir`, renamed to `out_dir` when the block succeeds (removed if not), and
    locked while it is built (`_clear_abandoned`, called first, leaves it alone). Nothing is ever overwritten:
    an `out_dir` that is filled meanwhile is refused too."""
    out = refuse_existing(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_abandoned(out.parent)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(held, fcntl.LOCK_EX)  # on the folder itself: a process killed in the block drops it
    try:
        with as_os_error(tmp):
            yield tmp
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{out}: was filled by someone else meanwhile; the folder stays unwritten")
        os.replace(tmp, out)  # POSIX rename replaces an empty directory
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)
