"""Fault 1: a bit flip or a truncation in each kind of checkpoint file, in the newest checkpoint or
in an older one, of a run that died after step 7 (checkpoints of steps 4 and 6 on disk)."""

import json
import shutil
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from ropelab.config import build_run_config
from ropelab.train import checkpoint as ckpt
from ropelab.train import integrity
from ropelab.train.integrity import DamagedCheckpoint
from ropelab.train.loop import train

from .helpers import (
    CHECKPOINT_FILES, DAMAGE, REASON, Crash, assert_intact, assert_one_line, assert_same_run, cli, crash_after,
    fault_overrides, listing, step_dir,
)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, tiny_session_overrides):
    run = tmp_path_factory.mktemp("crashed") / "run"
    with pytest.raises(Crash):
        train(build_run_config(overrides=fault_overrides(tiny_session_overrides)), run, callbacks=(crash_after(7),))
    assert listing(run) == ["step_00000004", "step_00000006"]
    return run


@pytest.fixture
def run(crashed, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(crashed, copy)
    return copy


def assert_refused(run, folder, name, capsys):
    """Asked for by name, a damaged checkpoint is refused in one line: by the library and by the CLI."""
    with pytest.raises(DamagedCheckpoint) as err:
        train(out_dir=run, resume=True, from_checkpoint=folder)
    assert err.value.folder == folder and err.value.file == name and "\n" not in str(err.value)
    step = int(folder.name.removeprefix("step_"))
    code, _, lines = cli(["train", "--out", run, "--resume", "--from-checkpoint", step], capsys)
    assert code == 2
    assert_one_line(lines, "ropelab: error:", folder, f"damaged checkpoint ({name}: ")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_damaged_newest_checkpoint_resumes_from_the_one_before(run, reference, name, damage, capsys):
    newest, older = step_dir(run, 6), step_dir(run, 4)
    DAMAGE[damage](newest / name)
    assert_refused(run, newest, name, capsys)
    train(out_dir=run, resume=True)
    line = assert_one_line(capsys.readouterr().err.splitlines(), f"{newest}: damaged ({name}: {REASON[damage]}")
    assert line.endswith("; falling back to step_00000004")
    assert_same_run(run, reference)  # and the damaged step 6 was written again, intact


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_damaged_older_checkpoint_does_not_matter(run, reference, name, damage, capsys):
    newest, older = step_dir(run, 6), step_dir(run, 4)
    DAMAGE[damage](older / name)
    assert_refused(run, older, name, capsys)
    train(out_dir=run, resume=True)
    assert capsys.readouterr().err == ""  # the newest verified: nothing passed over
    assert_same_run(run, reference)
    assert not older.exists()  # pruned by the step-8 save like any old checkpoint


def test_cli_resume_past_a_damaged_checkpoint_prints_one_line(run, reference, capsys):
    newest = step_dir(run, 6)
    DAMAGE["truncate"](newest / "dcp" / "__0_0.distcp")
    code, out, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 0 and out.startswith("done: 8 steps")
    assert_one_line(lines, f"{newest}: damaged (dcp/__0_0.distcp: truncated to", "falling back to step_00000004")
    assert_same_run(run, reference)


def test_cli_with_every_checkpoint_damaged_refuses_in_one_line_each(run, capsys):
    DAMAGE["flip"](step_dir(run, 6) / "state.pt")
    DAMAGE["truncate"](step_dir(run, 4) / "model.safetensors")
    before = {p: p.read_bytes() for p in ckpt.checkpoint_dir(run).rglob("*") if p.is_file()}
    code, _, lines = cli(["train", "--out", run, "--resume"], capsys)
    assert code == 2 and "Traceback" not in "\n".join(lines)
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"{step_dir(run, 6)}: damaged (state.pt: checksum mismatch")
    assert lines[1].startswith(f"{step_dir(run, 4)}: damaged (model.safetensors: truncated to")
    assert lines[0].endswith("falling back to nothing") and lines[1].endswith("falling back to nothing")
    assert lines[2] == f"ropelab: error: {run}: no intact checkpoint to resume from (every one is damaged)"
    assert {p: p.read_bytes() for p in ckpt.checkpoint_dir(run).rglob("*") if p.is_file()} == before  # nothing touched


def test_the_crashed_run_itself_is_intact(crashed):
    for step in (4, 6):
        assert_intact(step_dir(crashed, step))


# ------------------------------------------------------------------ checkpoints the checksums do not vouch for


def without_checksums(folder):
    """As written before manifests: no CHECKSUMS.json, a marker naming the step only."""
    (folder / integrity.MANIFEST).unlink()
    (folder / ckpt.MARKER).write_text(folder.name.removeprefix("step_").lstrip("0") + "\n")


def edit_weights(folder, edit):
    weights = load_file(str(folder / ckpt.WEIGHTS))
    edit(weights)
    save_file(weights, str(folder / ckpt.WEIGHTS))


def with_fresh_checksums(folder):
    """The manifest and marker written again for the files as they are now: their checksums hold."""
    (folder / integrity.MANIFEST).unlink()
    (folder / ckpt.MARKER).write_text(f"6\n{integrity.write_manifest(folder, {})}\n")


def test_an_unverified_checkpoint_is_exported_with_a_warning(run, tmp_path, capsys):
    newest = step_dir(run, 6)
    without_checksums(newest)
    code, out, lines = cli(["export", newest, "--out", tmp_path / "hf"], capsys)
    assert code == 0 and out.startswith("exported")
    ours = [line for line in lines if "ropelab" in line or "Traceback" in line]  # not transformers' progress bar
    assert_one_line(ours, f"ropelab: warning: {newest}: unverified (no checksums): written before checkpoints had "
                           "them; its weights were checked only for being finite")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_in_an_unverified_checkpoint_are_refused(run, tmp_path, capsys, value):
    newest = step_dir(run, 6)
    without_checksums(newest)
    edit_weights(newest, lambda weights: weights["blocks.1.mlp.up_proj.weight"].view(-1).__setitem__(5, value))
    code, out, lines = cli(["export", newest, "--out", tmp_path / "hf"], capsys)
    assert code == 2 and out == ""
    assert_one_line(lines, f"ropelab: error: {newest}: damaged checkpoint (model.safetensors: tensor "
                           "blocks.1.mlp.up_proj.weight holds NaN or infinite values; unverified (no checksums))")
    assert not (tmp_path / "hf").exists()


def test_an_unknown_checksum_manifest_format_is_refused(run, tmp_path, capsys):
    newest = step_dir(run, 6)
    manifest = json.loads((newest / integrity.MANIFEST).read_text())
    text = json.dumps({**manifest, "format": 2}, indent=1)
    (newest / integrity.MANIFEST).write_text(text)
    (newest / ckpt.MARKER).write_text(f"6\n{integrity.MANIFEST} crc32={zlib.crc32(text.encode()):08x}\n")
    code, out, lines = cli(["export", newest, "--out", tmp_path / "hf"], capsys)
    assert code == 2 and out == ""
    assert_one_line(lines, f"ropelab: error: {newest / integrity.MANIFEST}: format 2, which this ropelab cannot read "
                           f"(it reads format {integrity.FORMAT}); a newer ropelab wrote it")
    assert not (tmp_path / "hf").exists()


def test_a_weights_file_of_the_wrong_shape_is_refused_naming_the_tensor(run, tmp_path, capsys):
    newest = step_dir(run, 6)
    edit_weights(newest, lambda weights: weights.update({"blocks.0.attn.q_proj.weight": torch.zeros(32, 64)}))
    with_fresh_checksums(newest)
    assert ckpt.verify_checkpoint(newest) is True
    code, out, lines = cli(["export", newest, "--out", tmp_path / "hf"], capsys)
    assert code == 2 and out == ""
    assert_one_line(lines, f"ropelab: error: {newest / ckpt.WEIGHTS}: tensor blocks.0.attn.q_proj.weight has shape "
                           "[32, 64], but the checkpoint's config.yaml makes it [64, 64]")
    assert not (tmp_path / "hf").exists()
