"""Study report end to end on fake run directories written here (no training)."""

import base64
import csv
import json
import math
import zlib

import numpy as np
import pytest

from ropelab.config import build_run_config
from ropelab.study.report import write_report
from ropelab.study.run_folders import collect_runs
from ropelab.study.summary import COLUMNS, summarize

STEPS = 400
TOKENS_PER_STEP = 16 * 256


def fake_run(study, name, overrides, floor, seed=0, spike_at=None, status="done", steps=STEPS):
    """A run dir like `ropelab.train.loop.train` leaves: config.yaml, metrics.jsonl, result.json."""
    run = study / "runs" / name
    run.mkdir(parents=True)
    config = build_run_config({}, None, [f"seed={seed}", f"train.steps={STEPS}", *overrides])
    (run / "config.yaml").write_text(config.to_yaml())
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    s = np.arange(1, steps + 1)
    loss = floor + 6.0 * np.exp(-s / 40) + 0.3 * np.exp(-s / 300) + rng.normal(0, 0.02, s.size)
    if spike_at is not None:
        loss[spike_at : spike_at + 6] += [0.8, 1.2, 0.9, 0.5, 0.3, 0.1]
    rows = []
    for i, step in enumerate(s):
        row = {"step": int(step), "tokens": int(step) * TOKENS_PER_STEP, "loss": float(loss[i]), "lr": 4e-4,
               "grad_norm": 0.5, "tokens_per_s": 20_000.0}
        if step % 100 == 0:
            row["val_loss"] = float(floor + 0.05 + 6.0 * np.exp(-step / 40))
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 40')  # torn line
    if status == "done":
        result = {"run_dir": str(run), "steps": steps, "final_train_loss": float(loss[-1]),
                  "final_val_loss": rows[-1].get("val_loss", float("nan")), "tokens": steps * TOKENS_PER_STEP,
                  "wall_time_s": 12.5, "tokens_per_s": 21_000.0}
        (run / "result.json").write_text(json.dumps(result))
    elif status == "failed":
        (run / "error.txt").write_text("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    return run


@pytest.fixture()
def study(tmp_path):
    fake_run(tmp_path, "full", ["model.rope.fraction=1.0"], floor=3.00)
    fake_run(tmp_path, "r25", ["model.rope.fraction=0.25"], floor=3.001, spike_at=250)
    fake_run(tmp_path, "nope", ["model.rope.fraction=0"], floor=3.20)
    fake_run(tmp_path, "two_ch", ["model.rope.rotary_dims=2"], floor=3.10, status="failed", steps=150)
    return tmp_path


def test_collect_runs_reads_status_and_error(study):
    runs = {r.id: r for r in collect_runs(study)}
    assert set(runs) == {"full", "r25", "nope", "two_ch"}
    assert runs["full"].status == "done" and runs["full"].result["steps"] == STEPS
    assert len(runs["full"].metrics) == STEPS  # the torn last line is skipped
    assert runs["two_ch"].status == "failed" and "out of memory" in runs["two_ch"].error
    with pytest.raises(FileNotFoundError):
        collect_runs(study / "nowhere")


def test_summarize_rows(study):
    rows = {r["id"]: r for r in summarize(collect_runs(study))}
    assert set(COLUMNS) <= set(rows["full"])
    assert (rows["full"]["rotary_dims"], rows["full"]["head_dim"], rows["full"]["fraction"]) == (64, 64, 1.0)
    assert (rows["r25"]["rotary_dims"], rows["r25"]["fraction"], rows["r25"]["fraction_label"]) == (16, 0.25, "25%")
    assert (rows["nope"]["rotary_dims"], rows["nope"]["fraction_label"]) == (0, "NoPE")
    assert (rows["two_ch"]["rotary_dims"], rows["two_ch"]["fraction_label"]) == (2, "2 ch")
    assert rows["full"]["band"] == rows["r25"]["band"] == 0 and rows["nope"]["band"] == 1
    assert rows["two_ch"]["band"] is None and rows["two_ch"]["status"] == "failed"
    assert rows["r25"]["spikes"] == 1 and rows["r25"]["unrecovered_spikes"] == 0
    assert rows["full"]["spikes"] == rows["nope"]["spikes"] == 0
    assert rows["full"]["final_train_loss"] == pytest.approx(3.0 + 0.3 * math.exp(-380 / 300), abs=0.02)
    assert rows["full"]["final_val_loss"] == pytest.approx(3.05, abs=1e-3)
    assert rows["full"]["target_loss"] == pytest.approx(rows["full"]["final_train_loss"])
    assert 300 < rows["full"]["steps_to_target"] <= STEPS
    assert rows["r25"]["steps_to_target"] is not None and rows["nope"]["steps_to_target"] is None
    assert rows["full"]["tokens_to_target"] == rows["full"]["steps_to_target"] * TOKENS_PER_STEP
    assert (rows["full"]["seq_len"], rows["full"]["dataset"], rows["full"]["block"]) == (256, "stdlib", "sequential")


def test_summarize_with_given_target(study):
    rows = {r["id"]: r for r in summarize(collect_runs(study), target=3.5)}
    assert all(r["target_loss"] == 3.5 for r in rows.values())
    assert rows["nope"]["steps_to_target"] is not None


def test_write_report_outputs(study):
    paths = write_report(study)
    for name in ("summary.csv", "summary.json", "loss_curves.png", "final_loss.png", "report.md", "report.html"):
        assert (study / name).is_file() and (study / name).stat().st_size > 0, name
        assert paths[name] == study / name
    for name in ("loss_curves.png", "final_loss.png"):
        assert (study / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with open(study / "summary.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        table = list(reader)
    assert reader.fieldnames == COLUMNS
    assert sorted(r["id"] for r in table) == ["full", "nope", "r25", "two_ch"]
    by_id = {r["id"]: r for r in table}
    assert by_id["nope"]["band"] == "1" and by_id["two_ch"]["band"] == "" and by_id["two_ch"]["status"] == "failed"

    summary = json.loads((study / "summary.json").read_text())
    assert len(summary["runs"]) == 4 and summary["study"]["noise_source"] == "curves"

    md = (study / "report.md").read_text()
    assert "2 bands" in md and "shared with: 25%" in md and "NoPE" in md
    assert "1 found in 1 run(s), 0 unrecovered" in md and "out of memory" in md

    page = (study / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2
    first = page.split('src="data:image/png;base64,')[1].split('"')[0]
    assert base64.b64decode(first)[:4] == b"\x89PNG"
    assert "<table>" in page and "shared with: 25%" in page


def test_report_states_one_band_when_runs_agree(tmp_path):
    fake_run(tmp_path, "full", ["model.rope.fraction=1.0"], floor=3.0)
    fake_run(tmp_path, "half", ["model.rope.fraction=0.5"], floor=3.0)
    fake_run(tmp_path, "full_s1", ["model.rope.fraction=1.0"], floor=3.0, seed=1)
    write_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "no separate band found at this scale" in md
    assert "seed replicas" in md and "none found in any run" in md


def test_report_on_empty_study(tmp_path):
    (tmp_path / "runs").mkdir()
    write_report(tmp_path)
    assert "No runs found" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "loss_curves.png").is_file() and (tmp_path / "final_loss.png").is_file()


@pytest.mark.parametrize("make", ["missing", "empty", "run-folder"])
def test_report_on_a_folder_that_is_not_a_study_is_one_line(tmp_path, make, capsys):
    from ropelab.cli import main

    folder = tmp_path / make
    if make != "missing":
        folder.mkdir()
    if make == "run-folder":
        (folder / "config.yaml").write_text("{}")
    assert main(["report", str(folder), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    what = "no such folder" if make == "missing" else "not a study folder (no runs/ in it)"
    assert line == f"ropelab: error: {folder}: {what}; give the folder `ropelab study --out` wrote"
    assert not (tmp_path / "out").exists()
