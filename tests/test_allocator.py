"""ropelab.allocator: glibc keeps freed tensor buffers once asked, and is left alone where the user chose."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from ropelab import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")

# faults paging in a 48 MiB tensor, twice (above glibc's largest automatic mmap threshold, 32 MiB)
FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from ropelab.allocator import reuse_freed_memory
    applied = reuse_freed_memory() if sys.argv[1] == "reuse" else False

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(12 * 2**20)
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    print(applied, faults(), faults())
""")


def clean_environ() -> dict:
    """This process's environment without any malloc choice of the user's."""
    return {k: v for k, v in os.environ.items()
            if k not in allocator.USER_SETTINGS and k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}


def fault_counts(mode: str) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], env=clean_environ(), capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@needs_glibc
def test_freed_buffers_are_reused_instead_of_paged_in_again():
    applied, first, second = fault_counts("reuse")
    assert applied and first > 0
    assert second < first / 10  # the freed 48 MiB served the second tensor
    _, plain_first, plain_second = fault_counts("plain")
    assert plain_second > plain_first / 2  # glibc's defaults map and fault it in again


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
