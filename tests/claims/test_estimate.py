"""The claims' expected time: measured steps plus a per-run overhead that follows the study's engine."""

import dataclasses

import pytest

from ropelab.claims import estimate
from ropelab.study.grid import load_study


@pytest.fixture
def tiny_study(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("name: tiny\nbase: {preset: tiny-llama, model: {n_layer: 1, d_model: 32, n_head: 1, n_kv_head: 1, "
                    "d_ff: 64}, data: {seq_len: 64}, train: {steps: 10, micro_batch: 2}}\n"
                    "variants: [{name: a}, {name: b}]\n")
    return load_study(path)


def test_a_warm_engine_is_charged_less_start_up_per_run(tiny_study, monkeypatch):
    monkeypatch.setattr(estimate, "step_seconds", lambda *args: 0.5)  # the measured step, made exact
    eager = estimate.study_estimate(dataclasses.replace(tiny_study, engine="eager"))
    auto = estimate.study_estimate(dataclasses.replace(tiny_study, engine="auto"))
    assert [r["seconds"] for r in eager["runs"]] == [estimate.OVERHEAD["eager"] + 10 * 0.5] * 2
    assert [r["seconds"] for r in auto["runs"]] == [estimate.OVERHEAD["auto"] + 10 * 0.5] * 2
    assert 0 < estimate.OVERHEAD["auto"] < estimate.OVERHEAD["eager"]
    assert eager["seconds"] - auto["seconds"] == pytest.approx(2 * (estimate.OVERHEAD["eager"] - estimate.OVERHEAD["auto"]))
