"""ropelab.native: every C loop of ropelab builds once into the kernel cache, and where it is switched off
(ROPELAB_CPU_KERNEL=0) or cannot be built its module reports no library (a warning says why), so that
its callers run their torch paths."""

from __future__ import annotations

import pytest
import torch

from ropelab import layer_kernels, native
from ropelab.rope import cpu_kernel as rope_cpu
from ropelab.train import cross_entropy_kernel

MODULES = {"rope": (rope_cpu, "CPU RoPE kernel"), "layers": (layer_kernels, "CPU layer kernels"),
           "cross-entropy": (cross_entropy_kernel, "CPU cross-entropy kernel")}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_loop_builds_once_into_the_cache_and_switches_off(name, monkeypatch, tmp_path):
    module, what = MODULES[name]
    if native.c_compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("ROPELAB_CACHE", str(tmp_path))
    module.library.cache_clear()
    try:
        assert module.library() is not None
        built = list((tmp_path / "kernels").glob("*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob("tmp*"))  # no build folder left
        module.library.cache_clear()
        assert module.library() is not None and list((tmp_path / "kernels").glob("*.so")) == built  # reused
        monkeypatch.setenv("CC", "false")  # a "compiler" that always fails: only a new source would need it
        monkeypatch.setenv("ROPELAB_CACHE", str(tmp_path / "elsewhere"))
        module.library.cache_clear()
        with pytest.warns(UserWarning, match=f"{what} unavailable, using the torch path"):
            assert module.library() is None
        monkeypatch.setenv("ROPELAB_CPU_KERNEL", "0")
        module.library.cache_clear()
        assert module.library() is None
    finally:
        module.library.cache_clear()  # the next test builds (or finds) the real loop again


def test_the_cache_key_follows_the_source_and_the_cpu(tmp_path, monkeypatch):
    if native.c_compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("ROPELAB_CACHE", str(tmp_path))
    source = native.PRELUDE + "void ropelab_nothing(void) {}\n"
    first = native.compile_library(native.c_compiler(), source, "nothing")
    assert native.compile_library(native.c_compiler(), source, "nothing") == first
    monkeypatch.setattr(native, "cpu_model", lambda: "another CPU")
    assert native.compile_library(native.c_compiler(), source, "nothing") != first


def test_the_loops_take_contiguous_float32_and_bfloat16_cpu_tensors_only():
    x = torch.zeros(4, 6)
    assert native.runs_on(x, x.bfloat16())
    assert not native.runs_on(x, x.t())  # not contiguous
    assert not native.runs_on(x.half())
    assert not native.runs_on(torch.zeros(4, 6, device="meta"))
