import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def ropelab_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole test session, never the user's own."""
    path = os.environ.get("ROPELAB_TEST_CACHE") or str(tmp_path_factory.mktemp("ropelab-cache"))
    os.environ["ROPELAB_CACHE"] = path
    return path


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
