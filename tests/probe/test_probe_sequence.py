import json

import numpy as np
import pytest

from ropelab.config import ConfigError
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.probe.sequence import build_probe_input, probe_input_for, write_input

from probe_helpers import tiny_config


def test_block_layout_positions_and_documents(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghijklmnop")
    probe = probe_input_for(tiny_config(), ByteTokenizer(), block_len=10, repeats=3, text_file=str(text))
    block = [257, *b"abcdefgh", 256]  # BOS, 8 content bytes, EOS
    assert probe.input_ids().tolist() == block * 3 and probe.text == "abcdefgh"
    assert probe.analysis_positions().tolist() == [8, 18, 28]
    assert all(probe.input_ids()[p + 1] == 256 for p in probe.analysis_positions())  # each is the token before EOS
    assert probe.position_ids("running").tolist() == list(range(30))
    assert probe.position_ids("restart").tolist() == list(range(10)) * 3
    assert probe.doc_ids().tolist() == [0] * 10 + [1] * 10 + [2] * 10
    assert write_input(tmp_path, probe) == ["input.json", "input_ids.npy", "input.txt"]
    meta = json.loads((tmp_path / "input.json").read_text())
    assert meta["block_ids"] == block and meta["analysis_positions"] == [8, 18, 28] and meta["window"] == 30
    assert np.load(tmp_path / "input_ids.npy").tolist() == block * 3
    assert (tmp_path / "input.txt").read_text() == "abcdefgh"


def test_tokenizer_without_bos_starts_blocks_with_eos():
    class NoBos(ByteTokenizer):
        bos_id = None

    probe = build_probe_input(NoBos(), [1, 2, 3], 5, 2, "test")
    assert probe.input_ids().tolist() == [256, 1, 2, 3, 256] * 2


def test_validation_split_gives_real_text_without_special_tokens():
    probe = probe_input_for(tiny_config(), ByteTokenizer(), block_len=300, repeats=2)
    assert "validation document" in probe.source and len(probe.content_ids) == 298
    assert max(probe.content_ids) < 256 and probe.text.encode("utf-8", "replace")[:10] == bytes(probe.content_ids[:10])


def test_refusals(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="fewer than the 8"):
        probe_input_for(tiny_config(), ByteTokenizer(), 10, 2, str(short))
    with pytest.raises(ConfigError, match="no such file"):
        probe_input_for(tiny_config(), ByteTokenizer(), 10, 2, str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="no validation document"):
        probe_input_for(tiny_config(), ByteTokenizer(), 50_000_000, 2)
