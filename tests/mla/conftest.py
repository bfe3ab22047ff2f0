"""An MLA folder converted once from the session's tiny BPE run."""

import pytest

from ropelab.convert import convert_model

@pytest.fixture(scope="session")
def quick_convert():
    """`ropelab convert` settings for a tiny source: little calibration and held-out data."""
    return ("calibration.tokens=512", "calibration.seq_len=32", "eval.tokens=256", "eval.seq_len=32")


@pytest.fixture(scope="session")
def mla_folder(run, tmp_path_factory, quick_convert):
    """Read-only. 2 of 8 pairs per KV head by 2-norm, rank 6 per KV head: 2 x (6 + 4) cached values per layer
    of 2 x 2 x 16. Returns the folder and convert.json's content."""
    out = tmp_path_factory.mktemp("mla") / "r2d6"
    record = convert_model(str(run), out, ["rope.keep_pairs=2", "mla.rank=6", *quick_convert], log=lambda _: None)
    return out, record
