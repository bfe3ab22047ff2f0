"""A study's `lm_eval` key: its options checked when the study loads, every finished run evaluated once into
DIR/lm_eval, and the report's section."""

import inspect
import json
import shutil

import pytest

from ropelab.config import ConfigError
from ropelab.evaluate.lm_eval import evaluate_lm
from ropelab.study.grid import load_study
from ropelab.study.lm_eval_step import OPTIONS, evaluate_study_lm_eval
from ropelab.study.report import write_report
from tests.evaluate.local_tasks import write_tasks


def test_every_option_is_one_of_evaluate_lms():
    assert set(OPTIONS) <= set(inspect.signature(evaluate_lm).parameters)


@pytest.mark.parametrize("value, message", [
    ("{taks: [lambada_wiki]}", "lm_eval: unknown option 'taks'; allowed: tasks, include_path"),
    ("{tasks: [x], include_path: no/such/folder}", "lm_eval.include_path: no/such/folder is not a folder"),
    ("[lambada_wiki]", "lm_eval=.*must be a mapping"),
])
def test_bad_options_are_one_line_naming_the_file(tmp_path, value, message):
    path = tmp_path / "study.yaml"
    path.write_text(f"base: {{preset: tiny-llama}}\ngrid: {{seed: [0]}}\nlm_eval: {value}\n")
    with pytest.raises(ConfigError, match=f"^{path}: {message}") as error:
        load_study(path)
    assert "\n" not in str(error.value)


def test_finished_runs_are_evaluated_once_and_reported(run, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    (tmp_path / "tasks").mkdir()
    tasks = write_tasks(tmp_path / "tasks", {"cloze_local": ("cloze", [
        {"context": "for i in range(10):\n    print(", "word": "i"}, {"context": "import os\nimport", "word": " sys"}])})
    study_dir = tmp_path / "study"
    for name in ("a", "b"):
        shutil.copytree(run, study_dir / "runs" / name)
    options = {"tasks": ["cloze_local"], "include_path": str(tasks)}
    results = evaluate_study_lm_eval(study_dir, options, ["a", "b"])
    assert [entry["label"] for entry in results["runs"]] == ["a", "b"]
    a, b = (entry["metrics"]["cloze_local"]["acc"][0] for entry in results["runs"])
    assert a == b  # the same weights under two names
    assert evaluate_study_lm_eval(study_dir, options, ["a", "b"]) is None  # kept, not redone
    assert json.loads((study_dir / "lm_eval" / "results.json").read_text())["tasks"] == ["cloze_local"]
    write_report(study_dir)
    report = (study_dir / "report.md").read_text()
    assert "## lm-eval (zero-shot)" in report and "| cloze_local | acc ↑ |" in report
