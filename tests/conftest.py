import importlib.util
import os
import signal
import sys
from pathlib import Path, PurePath

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one test process per core: one torch thread each (two processes' 2-thread
    # OpenMP regions on 2 cores wait on each other whenever one is descheduled)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the subprocesses tests start

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A shell starts background jobs (`nohup pytest &`) with Ctrl-C ignored, and Python then leaves it so;
    # the tests of Ctrl-C (in this process and the ropelab processes it starts, which inherit an ignored
    # signal but not a handler) need Python's usual KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def ropelab_cache(tmp_path_factory):
    """One cache (tokenizers, tokens, imported models) for the whole test session, never the user's own.
    pytest-xdist's workers share it, beside their own temporary folders: an entry is built once, by the
    first worker that needs it, while the others wait (the cache's own locks, as two jobs on a cluster)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "ropelab-cache" if os.environ.get("PYTEST_XDIST_WORKER") else base / "ropelab-cache"
    path = os.environ.get("ROPELAB_TEST_CACHE") or str(shared)
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["ROPELAB_CACHE"] = path
    return path


@pytest.fixture(autouse=True)
def hub_environment(monkeypatch, tmp_path_factory):
    """The Hugging Face hub as a fresh shell sees it, whatever the user's shell sets: no offline
    switch (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE) and HF_HOME in one temporary
    folder for the session (no cache-path override either). huggingface_hub.constants and
    datasets.config read these at import, so where they are imported already their copies are
    patched too, as `ropelab.hub.set_offline` patches them. Everything is restored after the test."""
    home = tmp_path_factory.getbasetemp() / "hf-home"
    home.mkdir(exist_ok=True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(name, "")  # records the value to restore, also when unset: a test's own
        monkeypatch.delenv(name, raising=False)  # os.environ writes (set_offline) are undone after it
    monkeypatch.setenv("HF_HOME", str(home))
    read_at_import = (("huggingface_hub.constants", "HF_HOME", ["HF_HUB_OFFLINE"]),
                      ("datasets.config", "HF_CACHE_HOME", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"]))
    for module_name, home_name, flags in read_at_import:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for flag in flags:
            monkeypatch.setattr(module, flag, False)
        old = str(getattr(module, home_name))
        for name, value in list(vars(module).items()):  # the cache and token paths derived from HF_HOME
            if name.isupper() and isinstance(value, (str, PurePath)) and str(value).startswith(old):
                monkeypatch.setattr(module, name, type(value)(str(home) + str(value)[len(old):]))
    return home


TINY = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128",
    "data.tokenizer=bytes", "data.seq_len=32", "train.micro_batch=4", "train.steps=8", "train.eval_every=4",
    "train.eval_batches=2", "train.checkpoint_every=4", "train.progress=false", "train.lr=3e-3",
]


@pytest.fixture
def tiny_overrides():
    return list(TINY)


@pytest.fixture(scope="session")
def tiny_session_overrides():
    """TINY for module- and session-scoped fixtures (copy before extending)."""
    return tuple(TINY)


# A tiny trained run with a tokenizers-backed BPE, shared by the export and lm-eval tests.
TINY_BPE = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128",
    "data.tokenizer=bpe:300", "data.seq_len=32", "train.micro_batch=2", "train.steps=3", "train.eval_every=3",
    "train.eval_batches=1", "train.checkpoint_every=3", "train.progress=false",
]


@pytest.fixture(scope="session")
def run(tmp_path_factory, ropelab_cache):
    """Read-only: tests export and evaluate it but never write into it."""
    from ropelab.config import build_run_config
    from ropelab.train.loop import train

    run_dir = tmp_path_factory.mktemp("tiny_bpe") / "run"
    train(build_run_config(overrides=TINY_BPE), run_dir)
    return run_dir


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def benchmark_script():
    """load(name) -> the module of benchmarks/<name>.py (benchmarks are scripts, not a package)."""

    def load(name: str):
        if str(BENCHMARKS) not in sys.path:  # as when a script runs: it may import its sibling modules
            sys.path.append(str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
