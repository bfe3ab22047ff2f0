"""`ropelab claims` end to end with the studies rigged (the study pipeline replaced by a writer of
finished runs): selection, the report, timings kept across invocations, the dry-run plan, and
one clear error for a missing study config or an unknown claim."""

from __future__ import annotations

import json
import re

import pytest

from ropelab.claims import runner
from ropelab.claims.paths import CLAIMS_CONFIGS
from ropelab.config import ConfigError
from ropelab.study.grid import expand, load_study
from tests.claims.rigged import write_study

BANDS = {"nope": 3.0, "2ch": 2.95, "rope10": 2.50, "rope25": 2.50, "rope100": 2.49}


@pytest.fixture
def rigged(monkeypatch):
    calls = []

    def fake_run_and_report(study, study_dir, jobs=1, live=True):
        calls.append(study.name)
        if not (study_dir / "runs").is_dir():
            write_study(study_dir, BANDS)
        return {"statuses": {f"{v}-seed{s}": "done" for v in BANDS for s in (0, 1)}, "report": {}}

    monkeypatch.setattr(runner, "run_and_report", fake_run_and_report)
    return calls


def test_select_by_id_and_by_seed_number():
    assert [c.id for c in runner.select(["rq1", "rq2"])] == ["rq1", "rq2"]
    assert {c.seed for c in runner.select(["000"])} == {"partial-rope (000)"}
    assert len(runner.select(None)) == len(runner.CLAIMS) and len({c.id for c in runner.CLAIMS}) == len(runner.CLAIMS)
    with pytest.raises(ConfigError, match="--only: unknown claim 'rq9'"):
        runner.select(["rq9"])


def test_a_claim_is_judged_and_reported_and_a_rerun_adds_to_the_timings(tmp_path, rigged):
    outcome = runner.run_claims(["rq1"], tmp_path / "out", jobs=2, live=False)
    assert outcome["findings"]["rq1"].verdict.outcome == "holds"
    report = json.loads((tmp_path / "out" / "claims.json").read_text())
    assert [c["id"] for c in report["claims"]] == ["rq1"] and report["claims"][0]["verdict"] == "holds"
    assert report["meta"]["studies"][0]["name"] == "partial-stdlib" and report["meta"]["studies"][0]["runs"] == 10
    assert (tmp_path / "out" / "claims.html").read_text().count('href="#claim-rq1"') >= 1
    first = json.loads((tmp_path / "out" / "timings.json").read_text())["partial-stdlib"]
    runner.run_claims(["rq1"], tmp_path / "out", jobs=2, live=False)
    assert json.loads((tmp_path / "out" / "timings.json").read_text())["partial-stdlib"] >= first
    assert rigged == ["claims-partial-stdlib", "claims-partial-stdlib"]


def test_a_judge_that_cannot_read_its_study_gives_inconclusive_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_and_report", lambda study, study_dir, jobs=1, live=True: {"statuses": {}, "report": {}})
    outcome = runner.run_claims(["rq1"], tmp_path / "out", live=False)
    assert outcome["findings"]["rq1"].verdict.outcome == "inconclusive"
    assert "no runs/ folder" in outcome["findings"]["rq1"].verdict.reason


def test_a_missing_study_config_stops_before_any_run(tmp_path, rigged):
    with pytest.raises(ConfigError, match="partial-stdlib.yaml: claim 'rq1' needs this study config"):
        runner.run_claims(["rq1"], tmp_path / "out", configs=tmp_path)
    assert rigged == [] and not (tmp_path / "out").exists()


def test_the_dry_run_plans_runs_tokens_and_a_measured_time(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    text = re.sub(r"steps: \d+", "steps: 3", (CLAIMS_CONFIGS / "partial-stdlib.yaml").read_text())
    (folder / "partial-stdlib.yaml").write_text(text)
    runs = expand(load_study(folder / "partial-stdlib.yaml"))
    (plan,) = runner.plan_claims(["rq1", "rq6"], jobs=2, configs=folder)
    assert plan["study"] == "partial-stdlib" and plan["claims"] == ["rq1", "rq6"]
    assert len(plan["runs"]) == len(runs) and plan["tokens"] == len(runs) * 3 * 8 * 256
    assert 0 < plan["seconds"] < 600


def test_the_shipped_configs_folder_is_found():
    assert runner.needed_studies(runner.select(["rq1"]))["partial-stdlib"].name == "claims-partial-stdlib"
