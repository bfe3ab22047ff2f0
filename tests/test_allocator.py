"""ropelab.allocator: glibc keeps freed tensor buffers once asked, and is left alone where the user chose."""

import os
import platform
import subprocess
import sys

import pytest

from ropelab import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
MALLOC_ENVIRONMENT = (*allocator.USER_SETTINGS, "LD_PRELOAD", "GLIBC_TUNABLES")  # the user's malloc choices


class RecordingLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, option, value):
        self.calls.append((option, value))
        return 1


@needs_glibc
def test_glibc_gets_no_mmap_and_the_trim_threshold(monkeypatch):
    for key in MALLOC_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    libc = RecordingLibc()
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
    assert allocator.reuse_freed_memory() is True
    assert libc.calls == [(-4, 0), (-1, 1 << 30)]  # M_MMAP_MAX, M_TRIM_THRESHOLD (malloc.h)


@needs_glibc
def test_the_real_mallopt_takes_them():
    """In a fresh interpreter with no malloc setting of the user's, glibc accepts both values."""
    environ = {k: v for k, v in os.environ.items() if k not in MALLOC_ENVIRONMENT}
    out = subprocess.run([sys.executable, "-c", "from ropelab.allocator import reuse_freed_memory as r; print(r())"],
                         env=environ, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize("environ, reason", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
])
@needs_glibc
def test_a_malloc_chosen_by_the_user_is_left_alone(monkeypatch, environ, reason):
    assert reason in allocator.why_not_reuse(environ)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)

    def no_libc(*_):
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_libc)
    assert allocator.reuse_freed_memory() is False


@needs_glibc
def test_a_plain_environment_gets_the_setting():
    assert allocator.why_not_reuse({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}) is None


def test_outside_glibc_nothing_is_set(monkeypatch):
    monkeypatch.setattr(allocator.platform, "system", lambda: "Darwin")
    assert "not glibc" in allocator.why_not_reuse({})
    assert allocator.reuse_freed_memory() is False
