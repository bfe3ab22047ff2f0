"""The 001 claims in their two settings, on study folders made up by a fixture: the from-scratch study
decides, behind the teacher's advantage (without it every claim is "inconclusive: the teacher knows no
more than the student" and nothing else is read); the SmolLM2 transplants are a labelled second setting
that `--only 001` does not pick and that decides no claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ropelab.claims import teacher_advantage
from ropelab.claims.distill import DISTILL_CLAIMS, NO_ADVANTAGE, SCRATCH, SMOLLM2
from ropelab.claims.runner import select
from ropelab.claims.verdict import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE
from ropelab.config import ConfigError
from tests.claims.rigged import shipped_runs

SCRATCH_CLAIMS = {claim.id: claim for claim in DISTILL_CLAIMS if claim.studies == (SCRATCH.study,)}
STARTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # loss-by-position buckets over 1,024 bytes
LENGTHS = (128, 256, 512, 1024)


def dump(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def scratch_study(root: Path, tail: dict[str, float], passkey: dict[str, float]) -> Path:
    """Every run of the shipped from-scratch study with a result.json, and the study's longctx.json:
    per variant (and the teacher) a loss of `tail` from position 128 on and a passkey exact match of
    `passkey` beyond 128; seed N adds 0.01 N to the loss and takes 0.01 N off the passkey."""
    entries = []
    for run, folder, variant, shift in shipped_runs(root, SCRATCH.study):
        dump(folder / "result.json", {"steps": 640, "final_val_loss": tail[variant] - 0.5 + shift})
        cells = [{"length": n, "depth": 0.5, "exact_match": 1.0 if n <= 128 else passkey[variant] - shift} for n in LENGTHS]
        entries.append({"label": run.id, "tasks": {"passkey": {"cells": cells}},
                        "loss_by_position": {"buckets": [{"start": p, "loss": 5.0 if p < 128 else tail[variant] + shift}
                                                         for p in STARTS]}})
    settings = {"tasks": ["passkey"], "lengths": list(LENGTHS), "depths": [0.5], "items": 20, "distractors": 9,
                "loss_length": 1024, "seed": 0}
    dump(root / "longctx" / "longctx.json", {"settings": settings, "runs": entries})
    return root


def measurement(losses: list[float], accuracy: float) -> dict:
    ranges = [{"start": a, "end": b, "loss": v} for (a, b), v in zip([(64, 128), (128, 256), (256, 512), (512, 1024)], losses)]
    lengths = [{"length": n, "multiple": n // 128, "accuracy": accuracy, "interval": [accuracy / 2, accuracy], "n": 20}
               for n in LENGTHS]
    return {"loss_by_position": {"ranges": ranges}, "retrieval": {"lengths": lengths}}


def write_advantage(study: Path, advantage: bool) -> None:
    """The cached teacher advantage, as `study_advantage` keeps it."""
    reasons = ["teacher loss keeps falling" if advantage else "teacher loss does not keep falling",
               "teacher retrieval above chance", "CE student retrieval not above chance"]
    dump(study / "claims" / "teacher-advantage.json",
         {"advantage": advantage, "reasons": reasons, "corpus": "shakespeare", "short_window": 128, "length": 1024,
          "teacher": measurement([2.0, 1.9, 1.8, 1.7], 0.9), "student": measurement([2.5, 2.6, 2.7, 2.8], 0.1)})


TAIL = {"teacher": 1.5, "kd-10k-500k": 2.0, "ce-10k-500k": 2.5, "kd-500k": 2.1, "ce-500k": 2.6, "kd-10k": 2.2, "ce-10k": 2.7}
PASSKEY = {"teacher": 0.9, "kd-10k-500k": 0.6, "ce-10k-500k": 0.1, "kd-500k": 0.3, "ce-500k": 0.1, "kd-10k": 0.2, "ce-10k": 0.1}


@pytest.fixture(scope="module")
def separated(tmp_path_factory) -> Path:
    return scratch_study(tmp_path_factory.mktemp("separated"), TAIL, PASSKEY)


def judge(claim: str, study: Path):
    return SCRATCH_CLAIMS[claim].judge({SCRATCH.study: study})


def test_without_the_teachers_advantage_every_001_claim_is_inconclusive_but_still_measured(separated):
    write_advantage(separated, advantage=False)
    for claim in ("kd-beats-ce", "theta-schedule"):  # the probe claims need checkpoints this fixture lacks
        found = judge(claim, separated)
        assert found.verdict.outcome == INCONCLUSIVE and found.verdict.reason.startswith(NO_ADVANTAGE)
        assert "teacher loss does not keep falling" in found.verdict.reason
        assert found.measured.startswith("The teacher's advantage, measured first (shakespeare, short window 128")
        assert "Measured all the same, not a verdict" in found.measured
        header, rows = found.table  # the claim's own comparison, seeds and noise, to read
        assert header != ["measure", "teacher", "CE student"] and rows
    kd = judge("kd-beats-ce", separated)
    assert f'would read "{HOLDS}"' in kd.measured  # what the same figures give behind a teacher with the advantage


def test_with_the_advantage_the_scratch_study_decides_kd_against_ce_at_every_schedule(separated):
    write_advantage(separated, advantage=True)
    found = judge("kd-beats-ce", separated)
    assert found.verdict.outcome == HOLDS
    parts = [row[0] for row in found.table[1]]
    assert not any("needle" in part for part in parts)  # the study evaluates the passkey only
    assert [p.rsplit("theta ", 1)[1] for p in parts if "loss by position" in p] == ["10k -> 500k", "500k", "10k"]
    assert found.measured.startswith("The teacher's advantage, measured first (shakespeare, short window 128")
    assert "trained from scratch" in found.measured
    assert "kd-10k-500k 59.0 (60.0, 59.0, 58.0)" in found.measured  # the mean and every seed, passkey beyond 128 (%)
    assert found.note.startswith(f"Setting: {SCRATCH.label}. ") and "here at each of them" in found.note
    assert "passkey (exact match, %, by prompt length): teacher 128: 100, 256: 90" in found.note


def test_the_theta_schedule_is_judged_on_loss_and_passkey_beyond_the_short_window(tmp_path):
    study = scratch_study(tmp_path, TAIL | {"kd-500k": 1.9}, PASSKEY)
    write_advantage(study, advantage=True)
    found = judge("theta-schedule", study)
    assert found.verdict.outcome == DOES_NOT_HOLD and [row[1] for row in found.table[1]] == [DOES_NOT_HOLD, HOLDS]


def test_the_advantage_is_measured_once_and_only_on_finished_runs(separated, monkeypatch):
    calls = []
    monkeypatch.setattr(teacher_advantage, "teacher_advantage", lambda *runs: calls.append(runs) or {"advantage": True})
    (separated / "claims" / "teacher-advantage.json").unlink(missing_ok=True)
    teacher, student = separated / "runs" / "teacher", separated / "runs" / "ce-10k-500k-seed0"
    for _ in range(2):
        assert teacher_advantage.study_advantage(separated, teacher, student) == {"advantage": True}
    assert calls == [(str(teacher), str(student))]
    with pytest.raises(ConfigError, match="has not finished training"):
        teacher_advantage.study_advantage(separated / "other", separated / "other" / "teacher", student)


def test_the_smollm2_setting_is_labelled_and_decides_no_claim():
    chosen = select(["001"])
    assert [c.id for c in chosen] == list(SCRATCH_CLAIMS) == ["kd-beats-ce", "theta-schedule", "probe-perturbation",
                                                              "query-weights-band"]
    assert all(c.studies == (SCRATCH.study,) and c.decides for c in chosen)
    second = [c for c in DISTILL_CLAIMS if c.studies == (SMOLLM2.study,)]
    assert [c.id for c in second] == [f"smollm2-{c.id}" for c in chosen] and not any(c.decides for c in second)
    assert all(c.statement.startswith(f"[{SMOLLM2.label}; decides no claim] ") for c in second)
    assert [c.id for c in select(["smollm2-kd-beats-ce"])] == ["smollm2-kd-beats-ce"]
    assert SMOLLM2.label == "students that know language, distilled from their own instruct model"
