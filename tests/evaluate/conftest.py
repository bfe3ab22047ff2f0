"""A tiny trained run with a tokenizers-backed BPE, shared by the export and lm-eval tests."""

import pytest

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
