"""`ropelab convert ... mla.rank=d` on the tiny BPE run: the MLA folder, its record, loading it back, and the
one-line refusals."""

import json
import re

import pytest
import torch

from ropelab.cli import main
from ropelab.convert.run import RECORD
from ropelab.mla.attention import LatentAttention
from ropelab.sources import load

def test_the_folder_loads_as_an_mla_model_with_its_record(run, mla_folder):
    out, record = mla_folder
    saved = json.loads((out / RECORD).read_text())
    assert saved["settings"]["mla"] == {"rank": 6, "init": "svd-joint"}
    assert (saved["cache_values_per_token"], saved["cache_values_per_token_source"]) == (2 * 2 * 10, 2 * 2 * 32)
    assert saved["kl_to_source"] > 0
    model = load(out).model.eval()
    assert model.config.mla.rank == 6 and all(isinstance(b.attn, LatentAttention) for b in model.blocks)
    assert "blocks.0.attn.k_proj.weight" not in model.state_dict()
    ids = torch.randint(0, 250, (1, 20))
    with torch.no_grad():  # the saved weights are the converted ones: the same loss on the held-out check
        assert torch.isfinite(model(ids)[0]).all()


def test_all_pairs_and_full_rank_give_the_sources_logits(run, tmp_path, capsys, quick_convert):
    out = tmp_path / "full"
    assert main(["convert", str(run), "--out", str(out), "rope.keep_pairs=8", "rope.select=high", "mla.rank=16",
                 "mla.init=svd-split", *quick_convert]) == 0
    assert "latent of rank 16 per KV head (svd-split)" in capsys.readouterr().out
    source, converted = load(run).model.eval(), load(out).model.eval()
    ids = torch.randint(0, 250, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids)[0], source(ids)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("settings, message", [
    (["rope.keep_pairs=2", "mla.rank=0"], r"model.mla.rank=0: must be an integer >= 1"),
    (["rope.keep_pairs=2", "mla.rank=29"], r"model.mla.rank=29: above full rank 28"),
    (["rope.keep_pairs=2", "mla.rank=4", "mla.init=pca"], r"mla.init='pca': unknown; choose one of svd-joint, svd-split"),
    (["rope.keep_pairs=9", "mla.rank=4"], r"rope.keep_pairs=9: must be an integer in 0\.\.8"),
])
def test_bad_mla_settings_stop_in_one_line_before_writing(run, tmp_path, capsys, settings, message, quick_convert):
    out = tmp_path / "never"
    assert main(["convert", str(run), "--out", str(out), *settings, *quick_convert]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not out.exists()


def test_an_mla_source_is_refused_in_one_line(mla_folder, tmp_path, capsys, quick_convert):
    out, _ = mla_folder
    assert main(["convert", str(out), "--out", str(tmp_path / "again"), "rope.keep_pairs=1", "mla.rank=4", *quick_convert]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already an MLA model (model.mla.rank=6)" in err, err
    assert not (tmp_path / "again").exists()
