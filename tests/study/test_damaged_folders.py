"""A damaged study or run folder (a result.json truncated or of the wrong shape, a study.yaml that is not
a study record, a run's config.yaml with a repeated key) read by `ropelab report`, `fit`, `study` and
`export` and by the claims: one line naming the file and what it should hold, exit 2, nothing written
(issue #52). The folders are written here, without training."""

from __future__ import annotations

import json

import pytest
import yaml

from ropelab.cli import main
from ropelab.claims.study_folder import StudyFolder
from ropelab.config import ConfigError, build_run_config

FRONTIER_RUN = {"role": "cooldown", "group": "a", "variant": "a", "seed": 0, "params": 1000, "budget": 5.0,
                "tokens": 5000, "unit": "tokens_per_param"}
RESULT = {"run_dir": "runs/a", "steps": 4, "final_train_loss": 3.1, "final_val_loss": 3.2, "tokens": 5000,
          "wall_time_s": 1.0, "tokens_per_s": 5000.0, "skipped_steps": 0, "phases": [], "init_from": None,
          "branch_from": None}


@pytest.fixture()
def study(tmp_path):
    """A finished one-run frontier study as `ropelab study` leaves it."""
    folder = tmp_path / "study"
    run = folder / "runs" / "a"
    run.mkdir(parents=True)
    config = build_run_config({}, None, ["train.steps=4"])
    (run / "config.yaml").write_text(config.to_yaml())
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tokens": 1250 * s, "loss": 4.0 - s / 10}) + "\n"
                                               for s in range(1, 5)))
    (run / "result.json").write_text(json.dumps(RESULT))
    record = {"name": "s", "runs": {"a": config.to_dict()}, "frontier": {"a": FRONTIER_RUN}}
    (folder / "study.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return folder


def one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ropelab: error: ") and "Traceback" not in err, err
    return err.removeprefix("ropelab: error: ").strip()


DAMAGED_RESULTS = [
    ('{"run_dir": "runs/a", "steps": 4, "final_tr', "not valid JSON (line 1: Unterminated string starting at)"),
    ("", "not valid JSON (line 1: Expecting value)"),
    ("[1, 2]", "expected a JSON object with keys run_dir, steps, final_train_loss"),
    ('{"steps": "x", "tokens": 5}', "steps='x': must be a whole number >= 0"),
    ('{"steps": 4, "tokens": 1e400}', "tokens=inf: must be a whole number >= 0"),
    ('{"steps": 4, "final_val_loss": "low"}', "final_val_loss='low': must be a number or null"),
    ('{"steps": 4, "phases": [{"name": 1}]}', "phases=[{'name': 1}]: must be a list of"),
    ('{"steps": 4, "init_from": "x"}', "init_from='x': must be an object or null"),
    ('{"steps": 4, "colour": 1}', "unknown key 'colour'; allowed: run_dir, steps"),
    ('{"tokens": 4}', "no 'steps' key"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep to be a result"),
]


@pytest.mark.parametrize("text, problem", DAMAGED_RESULTS)
@pytest.mark.parametrize("command", ["report", "fit"])
def test_a_damaged_result_json_is_one_line(study, tmp_path, capsys, command, text, problem):
    """Before: a list or wrong types ended in AttributeError, ValueError or OverflowError tracebacks, deep
    nesting in a RecursionError, and `report` skipped a truncated one until a later reader refused it."""
    result = study / "runs" / "a" / "result.json"
    result.write_text(text)
    message = one_line(capsys, [command, str(study), "--out", str(tmp_path / "out")])
    assert message.startswith(f"{result}: the file is damaged: {problem}")
    assert not (tmp_path / "out").exists()


def test_result_json_that_is_not_utf8_is_one_line(study, tmp_path, capsys):
    result = study / "runs" / "a" / "result.json"
    result.write_bytes(b"\xff\xfe{}")
    assert one_line(capsys, ["report", str(study), "--out", str(tmp_path / "out")]) == (
        f"{result}: the file is damaged: not UTF-8 text")


DAMAGED_RECORDS = [
    ("- 1\n- 2\n", "the study record is damaged: expected a mapping of name, runs and frontier, got [1, 2]"),
    ("name: [1, 2]\n", "the study record is damaged: name=[1, 2]: must be the study's name (a string)"),
    ("name: s\nruns: 5\n", "the study record is damaged: runs=5: must map run ids to mappings"),
    ("name: s\nfrontier: x\n", "the study record is damaged: frontier='x': must map run ids to mappings"),
    ("name: s\nruns: {a: 5}\n", "the study record is damaged: runs.'a': must map a run id (a string) to a mapping, got 5"),
    ("name: s\nfrontier: {a: {role: cooldown}}\n", "frontier.a: no 'group'; the study record is damaged"),
    ("name: s\nfrontier: {a: {role: trunk, group: a, variant: a, seed: x, params: 1}}\n",
     "frontier.a.seed='x': must be an integer"),
    ("name: s\nname: t\n", "(line 2): key name is given twice (first at line 1); each key may appear once"),
    ("name: s\nruns: {a: [1\n", "(line 3): not valid YAML"),
]


@pytest.mark.parametrize("text, problem", DAMAGED_RECORDS)
@pytest.mark.parametrize("command", ["report", "fit"])
def test_a_damaged_study_yaml_is_one_line(study, tmp_path, capsys, command, text, problem):
    """Before: a list, a number for `runs` or a string for `frontier` ended in AttributeError tracebacks."""
    record = study / "study.yaml"
    record.write_text(text)
    message = one_line(capsys, [command, str(study), "--out", str(tmp_path / "out")])
    assert message.startswith(str(record)) and problem in message
    assert not (tmp_path / "out").exists()


def test_a_study_continued_in_a_folder_with_a_damaged_study_yaml_is_one_line(study, tmp_path, capsys):
    """`ropelab study --out` of an existing study reads its study.yaml first: before, an AttributeError."""
    (study / "study.yaml").write_text("- 1\n")
    config = tmp_path / "grid.yaml"
    config.write_text("name: s\nbase: {preset: tiny-llama, train: {steps: 4}}\nvariants: [{name: a}]\n")
    assert "the study record is damaged" in one_line(capsys, ["study", "--config", str(config), "--out", str(study)])


def test_the_claims_read_a_damaged_result_json_as_one_error(study):
    (study / "runs" / "a" / "result.json").write_text('{"steps": [4]}')
    with pytest.raises(ConfigError, match=r"result.json: the file is damaged: steps=\[4\]: must be a whole number"):
        StudyFolder(study).runs


def test_a_run_config_with_a_repeated_key_is_one_line_in_export(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "step_00000001" / "COMPLETE").write_text("")
    (run / "config.yaml").write_text("seed: 0\ntrain: {steps: 4}\nseed: 1\n")
    assert one_line(capsys, ["export", str(run), "--out", str(tmp_path / "hf")]) == (
        f"{run / 'config.yaml'} (line 3): key seed is given twice (first at line 1); each key may appear once")
    assert not (tmp_path / "hf").exists()


def test_an_undamaged_study_still_reports(study, tmp_path):
    assert main(["report", str(study), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.html").is_file()
