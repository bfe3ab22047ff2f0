"""`ropelab convert` on a tiny full-RoPE run: the folder, its record, export, recovery by KD, bad input."""

import dataclasses
import json
import re

import pytest
import torch

from ropelab.cli import main
from ropelab.config import ConfigError, build_run_config
from ropelab.convert import convert_model
from ropelab.convert.run import HEATMAP, RECORD
from ropelab.export.hf import export_hf
from ropelab.model import Transformer
from ropelab.sources import load
from ropelab.train.loop import train
from tests.helpers import assert_logits_match

QUICK = ["calibration.tokens=512", "calibration.seq_len=32", "eval.tokens=256", "eval.seq_len=32"]


@pytest.fixture(scope="module")
def converted(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert") / "2norm"
    record = convert_model(str(run), out, ["rope.keep_pairs=3", "rope.select=2-norm", *QUICK], log=lambda _: None)
    return out, record


def test_the_folder_is_a_model_source_with_its_record(run, converted):
    out, record = converted
    assert (out / HEATMAP).read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / RECORD).read_text())
    assert saved["select"] == "2-norm" and saved["keep_pairs"] == 3 and len(saved["pairs"]) == 2
    assert all(len(heads) == 2 and all(len(p) == 3 for p in heads) for heads in saved["pairs"])
    assert saved["rope_compute_saved"] == pytest.approx(1 - 3 / 8)
    assert saved["kl_to_source"] > 0 and saved["loss_converted"] > 0 and saved["tokens"] == 256
    loaded = load(out)
    assert [loaded.model.config.rope_for_layer(i).pairs for i in range(2)] == [
        p if len({tuple(h) for h in p}) > 1 else p[0] for p in saved["pairs"]]
    assert loaded.tokenizer.fingerprint() == load(run).tokenizer.fingerprint()


def test_the_export_gives_the_converted_logits(converted, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _ = converted
    info = export_hf(str(out), tmp_path / "hf")
    assert info["route"] == "remote_code"
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    ids = torch.randint(0, 250, (1, 30))
    ours = load(out).model
    with torch.no_grad():
        assert_logits_match(hf(ids).logits, ours(ids)[0], ours.config)


def test_recovery_by_kd_from_the_source_lowers_the_loss(run, converted, tmp_path, tiny_overrides):
    import ropelab.distill  # noqa: F401  (registers the KD objective, as the CLI does)

    out, record = converted
    config = build_run_config(overrides=[
        *tiny_overrides, "data.tokenizer=bpe:300", f"train.init_from={out}", f"distill.teacher={run}",
        "train.steps=20", "train.eval_every=10", "train.checkpoint_every=20", "train.lr=3e-3"])
    config.model = load(out).model.config
    result = train(config, tmp_path / "recover")
    rows = [json.loads(line) for line in (tmp_path / "recover" / "metrics.jsonl").read_text().splitlines()]
    kd = [r["kd"] for r in rows if "kd" in r]
    assert rows[0]["step"] == 0 and "val_loss" in rows[0]
    assert result.final_val_loss < rows[0]["val_loss"] and min(kd[-5:]) < kd[0]


def test_the_command_line_takes_settings_after_the_options(run, tmp_path, capsys):
    out = tmp_path / "high"
    assert main(["convert", str(run), "--out", str(out), "rope.keep_pairs=8", "rope.select=high", *QUICK]) == 0
    record = json.loads((out / RECORD).read_text())
    assert record["kl_to_source"] == pytest.approx(0.0, abs=1e-6)  # every pair kept: the source
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("settings, message", [
    (["rope.keep_pairs=9", "rope.select=high"], r"rope.keep_pairs=9: must be an integer in 0\.\.8"),
    (["rope.keep_pairs=2", "rope.select=best"], "rope.select='best': unknown"),
    (["rope.select=list", "rope.pairs=[[0, 1]]"], "rope.pairs: 1 entries but the model has 2 layers"),
    (["rope.select=high"], "rope.keep_pairs: required"),
    (["rope.keep_pairs=2", "calibration.corpus=/nonexistent"], "calibration.corpus='/nonexistent'"),
    (["rope.keep_pairs=2", "calibration.tokenz=5"], "calibration.tokenz: unknown key"),
    (["rope.keep_pairs=2", "calibration.seed=-1"], "calibration.seed=-1: must be >= 0"),
    (["rope.keep_pairs=2", "eval.seq_len=4294967296"], "eval.seq_len=4294967296: must be <= 2147483647"),
])
def test_bad_settings_stop_in_one_line_before_writing(run, tmp_path, capsys, settings, message):
    out = tmp_path / "never"
    assert main(["convert", str(run), "--out", str(out), *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not out.exists()


def test_a_source_without_full_rope_is_refused(tmp_path, tiny_overrides):
    train(build_run_config(overrides=[*tiny_overrides, "model.rope.fraction=0.5", "train.steps=1"]), tmp_path / "half")
    with pytest.raises(ConfigError, match="rotates 8 of its 16 channels"):
        convert_model(str(tmp_path / "half"), tmp_path / "out", ["rope.keep_pairs=2", *QUICK])
    assert not (tmp_path / "out").exists()


def test_an_existing_folder_is_never_overwritten(run, converted):
    out, _ = converted
    before = (out / RECORD).read_bytes()
    with pytest.raises(ConfigError):
        convert_model(str(run), out, ["rope.keep_pairs=2", *QUICK])
    assert (out / RECORD).read_bytes() == before


def test_calibration_data_in_another_tokenizer_is_refused(run, tmp_path):
    from ropelab.data.prepare import prepare
    from ropelab.data.sources import Source
    from ropelab.data.tokenizer import ByteTokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(30)))
    prepare(Source(str(docs)), ByteTokenizer(), tmp_path / "bytes", val_percent=20, workers=1, progress=False)
    with pytest.raises(ConfigError, match=r"calibration.corpus=.*bytes.*differs from the tokenizer"):
        convert_model(str(run), tmp_path / "out", ["rope.keep_pairs=2", f"calibration.corpus={tmp_path / 'bytes'}"])
    assert not (tmp_path / "out").exists()


def test_a_converted_folder_still_loads_after_it_is_moved(run, tmp_path):
    convert_model(str(run), tmp_path / "here", ["rope.keep_pairs=2", "rope.select=high", *QUICK], log=lambda _: None)
    (tmp_path / "here").rename(tmp_path / "there")
    loaded = load(tmp_path / "there")
    assert loaded.config.data.tokenizer == str((tmp_path / "there" / "tokenizer.json").resolve())
    assert loaded.tokenizer.fingerprint() == load(run).tokenizer.fingerprint()


def test_a_layer_kind_turned_nope_gives_the_logits_of_that_layout_built_directly(run, tmp_path):
    from ropelab.config import LayerKind

    layout = ["model.layer_pattern=LG", "model.layer_kinds={L: {}, G: {rope: none}}"]
    record = convert_model(str(run), tmp_path / "nope", [*layout, *QUICK], log=lambda _: None)
    assert record["keep_pairs_per_kind"] == {"L": 8, "G": 0} and record["pairs"][1] == [[], []]
    converted = load(tmp_path / "nope").model.eval()
    source = load(run).model
    config = dataclasses.replace(source.config, layer_pattern="LG", layer_kinds={"L": LayerKind(), "G": LayerKind(rope="none")})
    direct = Transformer(config).eval()
    direct.load_state_dict(source.state_dict())
    assert [block.attn.rope.rotary_dims for block in converted.blocks] == [16, 0]
    ids = torch.randint(0, 250, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids)[0], direct(ids)[0], rtol=0, atol=0)
        assert not torch.allclose(converted(ids)[0], source.eval()(ids)[0], atol=1e-4)


def test_a_layer_kind_keeps_its_own_plan_and_the_others_keep_the_runs(run, tmp_path):
    layout = ["model.layer_pattern=LG", "model.layer_kinds={L: {}, G: {rope: {keep_pairs: 2, select: high}}}"]
    record = convert_model(str(run), tmp_path / "plan", ["rope.keep_pairs=6", "rope.select=low", *layout, *QUICK],
                           log=lambda _: None)
    assert record["keep_pairs_per_kind"] == {"L": 6, "G": 2}
    assert record["pairs"] == [[[2, 3, 4, 5, 6, 7]] * 2, [[0, 1]] * 2]  # of 8 pairs: the run's 6 slowest, G's 2 fastest
    assert [block.attn.rope.rotary_dims for block in load(tmp_path / "plan").model.blocks] == [12, 4]


@pytest.mark.parametrize("settings, message", [
    (["model.layer_kinds={G: {rope: none}}"], r"model.layer_pattern=None: must be a non-empty string"),
    (["model.layer_pattern=LX", "model.layer_kinds={L: {}}"], "layer kind 'X' is not in model.layer_kinds"),
    (["model.layer_pattern=LG", "model.layer_kinds={L: {}, G: {temperature: {attn_scale: 0.1}}}"],
     "model.layer_kinds.G.temperature: only for NoPE layers"),
])
def test_a_bad_layout_stops_in_one_line_before_writing(run, tmp_path, capsys, settings, message):
    out = tmp_path / "never"
    assert main(["convert", str(run), "--out", str(out), *settings, *QUICK]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not out.exists()
