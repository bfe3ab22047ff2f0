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
