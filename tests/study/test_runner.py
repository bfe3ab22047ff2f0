import json
import shutil
from pathlib import Path

import pytest

from ropelab.config import ConfigError
from ropelab.study.grid import StudyConfig
from ropelab.study.runner import run_study
from ropelab.train.checkpoint import latest_checkpoint
from ropelab.train.metrics import read_metrics


def losses(run):
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run)]

BASE = {
    "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 1, "d_ff": 64},
    "data": {"tokenizer": "bytes", "seq_len": 16},
    "train": {"steps": 4, "micro_batch": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2},
}


def study(**grid):
    return StudyConfig(name="t", base=BASE, grid=grid or {"model.rope.fraction": [0.0, 1.0]})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Read-only: the two-run study, finished (tests copy it before changing anything)."""
    out = tmp_path_factory.mktemp("finished") / "study"
    assert run_study(study(), out, jobs=2, live=False) == {"fraction0": "done", "fraction1": "done"}
    return out


def copy_of(finished, tmp_path):
    return Path(shutil.copytree(finished, tmp_path / "study"))


def test_runs_finish_and_are_never_recomputed(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    metrics = (out / "runs/fraction0/metrics.jsonl").read_text()
    assert run_study(study(), out, live=False) == {"fraction0": "done", "fraction1": "done"}
    assert (out / "runs/fraction0/metrics.jsonl").read_text() == metrics


def test_unfinished_run_resumes_from_its_checkpoint(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    run = out / "runs/fraction1"
    full = losses(run)
    (run / "result.json").unlink()
    last = latest_checkpoint(run)
    last.rename(last.parent / ".deleted")  # as if the run died after its step-2 checkpoint
    assert run_study(study(), out, live=False)["fraction1"] == "done"
    assert losses(run) == full


def test_a_different_grid_is_refused(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    with pytest.raises(ConfigError, match="different grid"):
        run_study(study(**{"model.rope.fraction": [0.5]}), out, live=False)


def test_a_crashing_run_is_marked_failed_and_others_go_on(tmp_path):
    variants = [{"name": "broken", "data.tokenizer": str(tmp_path / "missing.json")}, {"name": "ok"}]
    statuses = run_study(StudyConfig(name="t", base=BASE, variants=variants), tmp_path, jobs=2, live=False)
    assert statuses == {"broken": "failed", "ok": "done"}
    assert "missing.json" in (tmp_path / "runs/broken/error.txt").read_text()
    assert json.loads((tmp_path / "runs/ok/result.json").read_text())["steps"] == 4


def test_study_command_writes_every_output(tmp_path, capsys):
    import yaml

    from ropelab.cli import main

    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"name": "cli", "base": BASE, "grid": {"model.rope.fraction": [0.0, 1.0]}}))
    assert main(["study", "--config", str(config), "--out", str(tmp_path / "s"), "--no-live", "--jobs", "2"]) == 0
    assert "2/2 runs finished" in capsys.readouterr().out
    for name in ("summary.csv", "summary.json", "loss_curves.png", "final_loss.png", "report.md", "report.html"):
        assert (tmp_path / "s" / name).stat().st_size > 0
    assert main(["report", str(tmp_path / "s"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.html").is_file()
