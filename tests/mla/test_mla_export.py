"""An MLA model exported as ropelab's own code: transformers loads it with trust_remote_code, gives its logits,
and generates over a DynamicCache that holds the latent; the DeepSeek-V3 layout is refused in one line."""

import pytest
import torch

from ropelab.cli import main
from ropelab.export.hf import export_hf
from ropelab.kv_cache import KVCache
from ropelab.sources import load


@pytest.fixture(scope="module")
def exported(mla_folder, tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("mla-hf") / "hf"
    return export_hf(str(mla_folder[0]), out), out


def test_remote_code_gives_the_logits_and_caches_the_latent(mla_folder, exported):
    from transformers import AutoModelForCausalLM, DynamicCache

    info, out = exported
    assert info["route"] == "remote_code" and "model.mla (rank 6)" in info["why"]
    assert {"mla_attention.py", "config_mla.py"} <= set(info["files"])
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    ours = load(mla_folder[0]).model.eval()
    ids = torch.randint(0, 250, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids)[0], rtol=0, atol=1e-5)
        cache = DynamicCache()
        hf(ids, past_key_values=cache, use_cache=True)
        # per layer the rotated pairs (2 KV heads x 4 channels) and the latent (2 x 6), not keys and values of 16
        assert tuple(cache.layers[0].keys.shape) == (1, 2, 20, 4) and tuple(cache.layers[0].values.shape) == (1, 2, 20, 6)
        generated = hf.generate(ids, max_new_tokens=6, do_sample=False)
        ours_ids, own_cache = ids, KVCache()
        logits = ours(ours_ids, kv_cache=own_cache)[0][:, -1]
        for _ in range(6):
            ours_ids = torch.cat([ours_ids, logits.argmax(-1, keepdim=True)], dim=1)
            logits = ours(ours_ids[:, -1:], kv_cache=own_cache)[0][:, -1]
    assert torch.equal(generated, ours_ids)


def test_ropelab_reads_the_exported_folder_back_as_the_same_mla_model(mla_folder, exported):
    _, out = exported
    ours, back = load(mla_folder[0]).model.eval(), load(out).model.eval()
    assert back.config.mla == ours.config.mla
    ids = torch.randint(0, 250, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(back(ids)[0], ours(ids)[0], rtol=0, atol=0)


def test_the_deepseek_v3_layout_is_refused_in_one_line(mla_folder, tmp_path, capsys):
    assert main(["export", str(mla_folder[0]), "--out", str(tmp_path / "ds"), "--layout", "deepseek-v3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--layout deepseek-v3: not built" in err, err
    assert not (tmp_path / "ds").exists()
