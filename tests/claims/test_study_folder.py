"""The claims' one reader of a study folder: a variant's runs by seed (seed 10 after seed 2), each run's
config checked, the schedule, the frontier record and points, everything read once; a study that has
not run, a missing variant and a run without config.yaml are each one ConfigError."""

from __future__ import annotations

import pytest

from ropelab.claims.study_folder import StudyFolder, variant_of
from ropelab.config import ConfigError
from tests.claims.rigged import CONFIG, write_frontier_study, write_run


def test_a_variants_runs_come_by_seed_and_are_read_once(tmp_path):
    for run_id in ("rope10-seed10", "rope10-seed2", "rope100-seed0", "rope10-seed1"):
        write_run(tmp_path, run_id, 2.0)
    study = StudyFolder(tmp_path)
    assert [run.id for run in study.seed_runs("rope10")] == ["rope10-seed1", "rope10-seed2", "rope10-seed10"]
    assert study.config(study.seed_runs("rope10")[1]).seed == 2 and variant_of("rope10-seed10") == "rope10"
    train, data = CONFIG["train"], CONFIG["data"]
    assert study.schedule() == (f"{train['steps']} steps x {train['micro_batch']} x {data['seq_len']} bytes, "
                                f"lr {train['lr']:g}, 3 seeds")
    with pytest.raises(ConfigError, match="has no run of variant 'nope'"):
        study.seed_runs("nope")
    write_run(tmp_path, "nope-seed0", 2.0)
    assert len(study.runs) == 4 and len(StudyFolder(tmp_path).runs) == 5


def test_a_frontier_study_gives_its_record_and_points(tmp_path):
    study = StudyFolder(write_frontier_study(tmp_path, {"nope": 0.5, "rope100": 0.0}, params=(50_000,), budgets=(5.0, 10.0)))
    assert len(study.frontier) == len(study.frontier_points) == 8
    with pytest.raises(ConfigError, match="no config.yaml"):  # the rigged frontier runs keep only result.json
        study.config(study.runs[0])


def test_a_study_that_has_not_run_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match="no runs/ folder: the study has not run"):
        StudyFolder(tmp_path).runs
