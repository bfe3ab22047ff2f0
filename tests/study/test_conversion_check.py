"""A conversion study's runs measured against their source after recovery, on the windows the conversion
was checked on: a run that never trained is exactly where its conversion left it."""

from __future__ import annotations

import json

import pytest

from ropelab.config import ConfigError
from ropelab.sources import distance_to_source, run_config
from ropelab.study import conversion_check
from ropelab.study.conversion import conversion_section
from ropelab.study.conversion_check import HELD_OUT, evaluate_study_conversion
from ropelab.train.loop import train


@pytest.fixture(scope="module")
def study(run, tmp_path_factory, tiny_session_overrides):
    """Read-only: the tiny BPE run converted to 2 pairs and a rank-6 latent, kept as converted (0 steps)
    and recovered for 4 steps, as a study's runs."""
    folder = tmp_path_factory.mktemp("conversion") / "study"
    for name, steps in (("converted", 0), ("recovered", 4)):
        train(run_config(overrides=[
            *tiny_session_overrides, "data.tokenizer=bpe:300", f"train.init_from={run}", "model.rope.keep_pairs=2",
            "model.rope.select=2-norm", "model.mla={rank: 6}", f"train.steps={steps}", "train.eval_every=4",
            "train.checkpoint_every=4", "train.calibration_tokens=256"]), folder / "runs" / name)
    return folder


def test_a_run_that_never_trained_is_where_its_conversion_left_it(study):
    recorded = json.loads((study / "runs" / "converted" / "result.json").read_text())["init_from"]["conversion"]
    measured = distance_to_source(study / "runs" / "converted")
    assert measured["tokens"] == recorded["tokens"]
    for key in ("loss_source", "loss_converted", "kl_to_source"):
        assert measured[key] == pytest.approx(recorded[key], rel=1e-5, abs=1e-6), key


def test_recovered_runs_are_measured_once_and_the_report_shows_them(study, tmp_path, monkeypatch):
    import shutil

    folder = tmp_path / "study"
    shutil.copytree(study, folder)
    measured = evaluate_study_conversion(folder, ["converted", "recovered"])
    assert list(measured) == ["recovered"]  # the converted run's distance is already in its result.json
    kl = measured["recovered"]["kl_to_source"]
    assert kl > 0 and json.loads(folder.joinpath(*HELD_OUT).read_text()) == measured
    monkeypatch.setattr(conversion_check, "distance_to_source", lambda run: pytest.fail(f"{run} measured again"))
    assert evaluate_study_conversion(folder, ["converted", "recovered"]) == measured
    row = next(line for line in conversion_section(folder).markdown.splitlines() if line.startswith("| recovered |"))
    assert f"| {kl:.3f} |" in row


def test_a_run_without_a_source_is_one_line(run):
    with pytest.raises(ConfigError, match=r"the run has no train.init_from, so no source to measure against"):
        distance_to_source(run)
