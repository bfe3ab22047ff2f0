"""`ropelab claims` end to end with the studies rigged (the study pipeline replaced by a writer of
finished runs): selection, the report, timings kept across invocations, the dry-run plan, and
one clear error for a missing study config or an unknown claim."""

from __future__ import annotations

import json

import pytest

from ropelab.claims import runner
from ropelab.claims.paths import CLAIMS_CONFIGS
from ropelab.config import ConfigError
from ropelab.study.grid import expand, load_study
from tests.claims.rigged import write_frontier_study

BANDS = {"nope": lambda d: 0.5 + 0.01 * d, "2ch": lambda d: 0.45 + 0.01 * d, "rope10": lambda d: 0.03 * (3 - d) / 3,
         "rope25": 0.0, "rope100": 0.0}


@pytest.fixture
def rigged(monkeypatch):
    calls = []

    def fake_run_and_report(study, study_dir, jobs=1, live=True):
        calls.append(study.name)
        if not (study_dir / "runs").is_dir():
            write_frontier_study(study_dir, BANDS)
        return {"statuses": {path.name: "done" for path in (study_dir / "runs").iterdir()}, "report": {}}

    monkeypatch.setattr(runner, "run_and_report", fake_run_and_report)
    return calls


def test_select_by_id_and_by_seed_number():
    assert [c.id for c in runner.select(["rq1", "rq2"])] == ["rq1", "rq2"]
    assert {c.seed for c in runner.select(["000"])} == {"partial-rope (000)"}
    assert len(runner.select(None)) == len(runner.CLAIMS) and len({c.id for c in runner.CLAIMS}) == len(runner.CLAIMS)
    with pytest.raises(ConfigError, match="--only: unknown claim or seed 'rq9'"):
        runner.select(["rq9"])


@pytest.mark.parametrize("name", ["0", "00", "1"])
def test_a_seed_number_selects_that_seed_only(name):
    assert {c.seed for c in runner.select([name])} == {"partial-rope (000)" if name.startswith("0") else
                                                       "short-data-long-context (001)"}


@pytest.mark.parametrize("name", ["rope", "partial", "rq", "q1", "(000)", "2", "-1", "²"])
def test_only_never_matches_a_part_of_a_name(name, capsys):
    from ropelab.cli import main

    assert main(["claims", "--only", f"rq1,{name}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--only: unknown claim or seed {name!r}" in err
    assert "rq1, rq2" in err and "kd-beats-ce" in err and "000, 001" in err


def test_a_claim_is_judged_and_reported_and_a_rerun_adds_to_the_timings(tmp_path, rigged):
    outcome = runner.run_claims(["rq1"], tmp_path / "out", jobs=2, live=False)
    assert outcome["findings"]["rq1"].verdict.outcome == "holds"
    report = json.loads((tmp_path / "out" / "claims.json").read_text())
    assert [c["id"] for c in report["claims"]] == ["rq1"] and report["claims"][0]["verdict"] == "holds"
    assert "tokens per non-embedding parameter" in report["claims"][0]["regime"]
    assert report["meta"]["studies"][0]["name"] == "partial-scaling" and report["meta"]["studies"][0]["runs"] == 80
    assert (tmp_path / "out" / "claims.html").read_text().count('href="#claim-rq1"') >= 1
    first = json.loads((tmp_path / "out" / "timings.json").read_text())["partial-scaling"]
    runner.run_claims(["rq1"], tmp_path / "out", jobs=2, live=False)
    assert json.loads((tmp_path / "out" / "timings.json").read_text())["partial-scaling"] >= first
    assert rigged == ["claims-partial-scaling", "claims-partial-scaling"]


def test_a_judge_that_cannot_read_its_study_gives_inconclusive_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_and_report", lambda study, study_dir, jobs=1, live=True: {"statuses": {}, "report": {}})
    outcome = runner.run_claims(["rq1"], tmp_path / "out", live=False)
    assert outcome["findings"]["rq1"].verdict.outcome == "inconclusive"
    assert "no finished frontier runs" in outcome["findings"]["rq1"].verdict.reason


def test_a_missing_study_config_stops_before_any_run(tmp_path, rigged):
    with pytest.raises(ConfigError, match="partial-scaling.yaml: claim 'rq1' needs this study config"):
        runner.run_claims(["rq1"], tmp_path / "out", configs=tmp_path)
    assert rigged == [] and not (tmp_path / "out").exists()


def test_the_dry_run_plans_runs_tokens_and_a_measured_time(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    text = (CLAIMS_CONFIGS / "partial-pythia.yaml").read_text().replace("budgets: [2.5, 5, 10, 20]", "budgets: [0.1, 0.2]")
    (folder / "partial-pythia.yaml").write_text(text)
    runs = expand(load_study(folder / "partial-pythia.yaml"))
    (plan,) = runner.plan_claims(["rq4"], jobs=2, configs=folder)
    assert plan["study"] == "partial-pythia" and plan["claims"] == ["rq4"] and len(plan["runs"]) == len(runs)
    trained = {run.id: run.config.train.steps - (run.config.train.branch_step or 0) for run in runs}
    assert plan["tokens"] == sum(trained.values()) * 8 * 256  # a branch trains from its trunk's step on
    assert plan["tokens_per_param"] == pytest.approx(0.2, rel=0.05)  # budgets round to whole steps
    assert 0 < plan["seconds"] < 600


def test_the_shipped_configs_folder_is_found():
    assert runner.needed_studies(runner.select(["rq1"]))["partial-scaling"].name == "claims-partial-scaling"


def test_the_dry_run_prices_a_teacher_the_study_trains_once_per_shared_cache(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    text = (CLAIMS_CONFIGS / "distill-scratch.yaml").read_text()
    (folder / "distill-scratch.yaml").write_text(text)
    (plan,) = runner.plan_claims(["001"], jobs=2, configs=folder)
    assert plan["study"] == "distill-scratch" and len(plan["runs"]) == 19 and plan["teacher_seconds"] > 0
    (folder / "distill-scratch.yaml").write_text(text.replace("teacher_cache: true\n", ""))
    (unshared,) = runner.plan_claims(["001"], jobs=2, configs=folder)
    # three KD students per seed run the teacher themselves: 3x, within the noise of the rate measured each time
    assert unshared["teacher_seconds"] > 2 * plan["teacher_seconds"]
    (folder / "distill-scratch.yaml").write_text(text.replace(', distill: {teacher: "@teacher", top_k: 32}', ""))
    (ce_only,) = runner.plan_claims(["001"], jobs=2, configs=folder)
    assert ce_only["teacher_seconds"] == 0.0 and ce_only["tokens"] == plan["tokens"]
