"""KD runs of a study that share a teacher and their batches read one cache of its targets."""

import pytest
import yaml

from ropelab.config import ConfigError
from ropelab.study.grid import StudyConfig, expand
from ropelab.study.runner import run_study
from ropelab.study.teacher_cache import FOLDER, shared_caches

STUDENT = {"model": {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 1, "d_ff": 64},
           "data": {"tokenizer": "bpe:300", "seq_len": 32},
           "train": {"steps": 2, "micro_batch": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2,
                     "progress": False, "tensorboard": False}}


def study(run, **extra) -> StudyConfig:
    distill = {"teacher": str(run), "top_k": 8}
    return StudyConfig(name="kd", base={"preset": "tiny-llama", **STUDENT, "distill": distill}, variants=[
        {"name": "kd-a"}, {"name": "ce", "distill.alpha": 0.0},
        {"name": "longer", "data.seq_len": 64}], **extra)


def test_runs_on_the_same_batches_share_one_cache(run, tmp_path):
    statuses = run_study(study(run, teacher_cache=True), tmp_path, jobs=2, live=False)
    assert set(statuses.values()) == {"done"}
    caches = sorted(p.name for p in (tmp_path / FOLDER).iterdir())
    assert len(caches) == 2  # seq_len 32 (kd-a, ce) and seq_len 64 (longer)
    used = {r: yaml.safe_load((tmp_path / "plan" / f"{r}.yaml").read_text())["distill"]["logits_cache"]
            for r in statuses}
    assert used["kd-a"] == used["ce"] != used["longer"]
    assert {str(tmp_path / FOLDER / name) for name in caches} == set(used.values())
    recorded = yaml.safe_load((tmp_path / "study.yaml").read_text())["runs"]["kd-a"]["distill"]
    assert recorded["logits_cache"] is None  # the study record keeps the configs as written


def test_sharing_needs_top_k(run, tmp_path):
    config = study(run)
    config.base["distill"] = {"teacher": str(run)}
    with pytest.raises(ConfigError, match="run kd-a: teacher_cache needs distill.top_k"):
        shared_caches(expand(config), tmp_path)


def scratch_study(teacher_overrides: dict) -> StudyConfig:
    """A teacher the study trains, then students that name it ("@teacher"): two on seed 0's batches, one on seed 1's."""
    students = [{"name": name, "seed": seed, "distill": {"teacher": "@teacher", "top_k": 8}}
                for name, seed in (("kd-a", 0), ("kd-b", 0), ("kd-c", 1))]
    return StudyConfig(name="scratch", teacher_cache=True, base={"preset": "tiny-llama", **STUDENT},
                       variants=[{"name": "teacher", "model.n_layer": 2, **teacher_overrides}, *students])


def test_students_of_a_teacher_the_study_trains_share_its_targets_per_data_order(tmp_path):
    statuses = run_study(scratch_study({}), tmp_path, jobs=2, live=False)
    assert set(statuses.values()) == {"done"}
    used = {r: yaml.safe_load((tmp_path / "plan" / f"{r}.yaml").read_text())["distill"]["logits_cache"]
            for r in ("kd-a", "kd-b", "kd-c")}
    assert used["kd-a"] == used["kd-b"] != used["kd-c"]
    assert len(list((tmp_path / FOLDER).iterdir())) == 2
    teacher = yaml.safe_load((tmp_path / "plan" / "kd-a.yaml").read_text())["distill"]["teacher"]
    assert teacher == str(tmp_path / "runs" / "teacher")  # the reference resolved before the targets were written


def test_a_teacher_that_cannot_give_targets_fails_its_students_with_the_reason(tmp_path):
    statuses = run_study(scratch_study({"data.tokenizer": "bytes"}), tmp_path, jobs=2, live=False)
    assert statuses["teacher"] == "done"
    assert {statuses[r] for r in ("kd-a", "kd-b", "kd-c")} == {"failed"}
    assert (tmp_path / "runs" / "kd-a" / "error.txt").read_text().startswith("teacher targets: ")
