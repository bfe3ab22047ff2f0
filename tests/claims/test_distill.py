"""The distillation claims judged on rigged study folders: the runs' config.yaml and result.json, the
study's longctx.json, and the claims' cached evaluations (probe folders, the teacher's passkey) as
the judges leave them, so that nothing loads SmolLM2. Measurements that separate give `holds`, the
reverse gives `does not hold`; a missing evaluation runs once and is then read from its folder; every
shipped distillation study config loads and expands."""

from __future__ import annotations

import json
from pathlib import Path

from ropelab.claims import distill_evals
from ropelab.claims.distill import DISTILL_CLAIMS, SETTINGS, SMOLLM2
from ropelab.claims.distill_evals import CAUSAL, DOC, PROBE_MODES, TEACHER
from ropelab.claims.paths import CLAIMS_CONFIGS
from ropelab.claims.study_folder import StudyFolder
from ropelab.claims.verdict import DOES_NOT_HOLD, HOLDS
from ropelab.study.grid import expand, load_study
from tests.claims.rigged import shipped_runs

STUDY, KD, CE, CONSTANT = SMOLLM2.study, SMOLLM2.kd, SMOLLM2.ce, SMOLLM2.constant
CLAIMS = {claim.id.removeprefix("smollm2-"): claim for claim in DISTILL_CLAIMS if claim.studies == (STUDY,)}
POSITIONS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # bucket starts of 1,024 positions in 10 log buckets
PAIRS = 32  # head_dim 64


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


NIAH = "niah_single_2"


def write_runs(study: Path, val_loss: dict[str, float], tail: dict[str, float], needle: dict[str, float] | None = None) -> Path:
    """Every run of the shipped study (its config.yaml, a result.json) and the study's longctx.json:
    per variant a final validation loss, a loss of `tail` at positions 128 and beyond, and a RULER needle
    score of `needle` (%) and passkey exact match of `needle` / 100 beyond 128; the second seed 0.01
    higher (its needle score 0.1 lower)."""
    needle = needle or {variant: 50.0 for variant in val_loss}
    entries = []
    for run, folder, variant, shift in shipped_runs(study, STUDY):
        write_json(folder / "result.json", {"steps": 40, "final_val_loss": val_loss[variant] + shift})
        losses = [9.0 if p < 128 else tail[variant] + shift for p in POSITIONS]
        found = {n: 100.0 if n <= 128 else needle[variant] - 10 * shift for n in (128, 1024)}
        cells = [{"length": n, "depth": d, "mrr": 0.3, "exact_match": found[n] / 100} for n in (128, 1024) for d in (0.0, 1.0)]
        entries.append({"label": run.id, "tasks": {"passkey": {"cells": cells},
                                                   NIAH: {"cells": [{"length": n, "score": found[n]} for n in found]}},
                        "loss_by_position": {"buckets": [{"start": p, "loss": v} for p, v in zip(POSITIONS, losses)]}})
    settings = {"tasks": ["passkey", NIAH], "lengths": [128, 1024], "depths": [0.0, 1.0], "items": 2, "distractors": 9,
                "loss_length": 1024, "seed": 0}
    write_json(study / "longctx" / "longctx.json", {"settings": settings, "runs": entries})
    teacher_cells = [{"length": n, "depth": d, "exact_match": 1.0, "mrr": 1.0} for n in (128, 1024) for d in (0.0, 1.0)]
    teacher = {"rope_theta": 100000.0, "tasks": {"passkey": {"cells": teacher_cells},
                                                 NIAH: {"cells": [{"length": n, "score": 100.0} for n in (128, 1024)]}}}
    write_json(study / "claims" / "longctx-teacher" / "longctx.json", {"runs": [teacher]})
    return study


def write_probe(folder: Path, kl: list[dict[str, float]], per_pair: list[float] | None = None) -> None:
    """A probe folder as `run_probe` writes it: per checkpoint and mode the logits' KL, and with two
    checkpoints the query weights' change per pair from the first to the second."""
    labels = [f"ckpt{i}" for i in range(len(kl))]
    write_json(folder / "probe.json", {"checkpoints": [{"label": label} for label in labels]})
    for label, by_mode in zip(labels, kl):
        for mode, value in by_mode.items():
            write_json(folder / label / mode / "metrics.json", {"captures": {"logits": {"mean_kl": value, "kl": [0.0] + [value] * 7}}})
    if per_pair is not None:
        write_json(folder / f"weights_{labels[0]}__{labels[1]}.json", {"layers": [{"q": {"per_pair": per_pair}}] * 4})


def write_probes(study: Path, short: float, long: float, doc: float, mid: float = 0.02, rest: float = 0.02) -> Path:
    """Probe folders of the KD runs (seed s adds s * 1e-6 to the KL) and of the teacher; the query
    weights change by `mid` in the middle third of the pairs and by `rest` elsewhere."""
    per_pair = [mid if PAIRS // 3 <= i < 2 * PAIRS // 3 else rest for i in range(PAIRS)]
    for seed in (0, 1):
        step = seed * 1e-6
        write_probe(study / "claims" / f"probe-{KD}-seed{seed}",
                    [{CAUSAL: short + step, DOC: doc}, {CAUSAL: long + step, DOC: doc}], [v + step for v in per_pair])
    write_probe(study / "claims" / "probe-teacher", [{CAUSAL: 1e-3, DOC: doc}])
    return study


LOSSES = {KD: 6.0, CE: 6.5, CONSTANT[0]: 6.1, CONSTANT[1]: 6.1}
TAILS = {KD: 6.2, CE: 6.8, CONSTANT[0]: 6.4, CONSTANT[1]: 6.5}
NEEDLE = {KD: 80.0, CE: 40.0, CONSTANT[0]: 50.0, CONSTANT[1]: 60.0}


def judge(claim: str, study: Path):
    return CLAIMS[claim].judge({STUDY: study})


def test_kd_beats_ce_on_both_losses_and_retrieval_or_not(tmp_path):
    found = judge("kd-beats-ce", write_runs(tmp_path / "a", LOSSES, TAILS, NEEDLE))
    assert found.verdict.outcome == HOLDS and [row[1] for row in found.table[1]] == [HOLDS] * 4
    assert found.figure.startswith(b"\x89PNG") and f"{KD} 6.005 (6.000, 6.010)" in found.measured
    assert "theta 10k -> 1M" in found.measured and f"needle score beyond 256 tokens (%): {KD} 80.0 (80.0, 79.9)" in found.measured
    assert f"{NIAH} (RULER string_match_all, %, by prompt length): SmolLM2 128: 100, 1024: 100; {KD} 128: 100, 1024: 80" \
        in found.note and "passkey (exact match, %, by prompt length): SmolLM2 128: 100" in found.note
    assert "initialised from smollm2-135m" in found.measured
    assert found.note.startswith(f"Setting: {SMOLLM2.label} (a second setting: it decides no claim). ")
    assert found.regime == "students initialised from smollm2-135m, then 40,960 short + 40,960 long tokens"
    ce_better_beyond = judge("kd-beats-ce", write_runs(tmp_path / "b", LOSSES, TAILS | {CE: 6.0}, NEEDLE))
    assert ce_better_beyond.verdict.outcome == DOES_NOT_HOLD
    assert [row[1] for row in ce_better_beyond.table[1]] == [HOLDS, HOLDS, HOLDS, DOES_NOT_HOLD]
    ce_retrieves = judge("kd-beats-ce", write_runs(tmp_path / "c", LOSSES, TAILS, NEEDLE | {CE: 95.0}))
    assert [row[1] for row in ce_retrieves.table[1]] == [HOLDS, DOES_NOT_HOLD, DOES_NOT_HOLD, HOLDS]


def test_theta_schedule_needs_the_phase_wise_run_above_both_constant_ones(tmp_path):
    found = judge("theta-schedule", write_runs(tmp_path / "a", LOSSES, TAILS, NEEDLE))
    assert found.verdict.outcome == HOLDS and "constant 10k and constant 1M" in found.measured
    assert "trained at theta 100k: no setup here keeps that theta" in found.note
    constant_below = judge("theta-schedule", write_runs(tmp_path / "b", LOSSES, TAILS | {CONSTANT[1]: 6.0}, NEEDLE))
    assert constant_below.verdict.outcome == DOES_NOT_HOLD and CONSTANT[1] in constant_below.verdict.reason
    assert "longest wavelength at theta 10k is 47,117 tokens" in constant_below.note
    retrieves_less = judge("theta-schedule", write_runs(tmp_path / "c", LOSSES, TAILS, NEEDLE | {CONSTANT[0]: 90.0}))
    assert [row[1] for row in retrieves_less.table[1]] == [HOLDS, DOES_NOT_HOLD, DOES_NOT_HOLD]


def test_probe_perturbation_present_absent_and_smaller_after_the_long_phase(tmp_path):
    study = write_probes(write_runs(tmp_path / "a", LOSSES, TAILS), short=1e-4, long=5e-5, doc=0.0)
    found = judge("probe-perturbation", study)
    assert found.verdict.outcome == HOLDS and len(found.table[1]) == 3
    assert found.figure.startswith(b"\x89PNG")
    leaks = write_probes(write_runs(tmp_path / "b", LOSSES, TAILS), short=1e-4, long=5e-5, doc=1e-3)
    found = judge("probe-perturbation", leaks)
    assert found.verdict.outcome == DOES_NOT_HOLD and found.table[1][1][1] == DOES_NOT_HOLD
    grows = write_probes(write_runs(tmp_path / "c", LOSSES, TAILS), short=5e-5, long=1e-4, doc=0.0)
    assert judge("probe-perturbation", grows).table[1][2][1] == DOES_NOT_HOLD


def test_query_weights_change_most_in_the_mid_band_or_not(tmp_path):
    study = write_probes(write_runs(tmp_path / "a", LOSSES, TAILS), 1e-4, 5e-5, 0.0, mid=0.05, rest=0.02)
    found = judge("query-weights-band", study)
    assert found.verdict.outcome == HOLDS and "mid frequency 0.0500" in found.measured
    flat_mid = write_probes(write_runs(tmp_path / "b", LOSSES, TAILS), 1e-4, 5e-5, 0.0, mid=0.01, rest=0.02)
    assert judge("query-weights-band", flat_mid).verdict.outcome == DOES_NOT_HOLD


def test_a_missing_probe_runs_once_on_the_phase_checkpoints_then_is_read_back(tmp_path, monkeypatch):
    study = StudyFolder(write_runs(tmp_path, LOSSES, TAILS))
    run = study.seed_runs(KD)[0]
    checkpoints = {"short": run.path / "checkpoints" / "step_00000030", "long": run.path / "checkpoints" / "step_00000040"}
    calls = []

    def fake_probe(sources, folder, config):
        calls.append((sources, Path(folder).name, config))
        write_probe(Path(folder), [{CAUSAL: 1e-4, DOC: 0.0}, {CAUSAL: 5e-5, DOC: 0.0}], [0.02] * PAIRS)

    monkeypatch.setattr(distill_evals, "run_probe", fake_probe)
    monkeypatch.setattr(distill_evals, "phase_checkpoints", lambda run_dir: checkpoints)
    shape = distill_evals.probe_shape(study, KD)
    assert shape == (256, 8)  # blocks of the phase-1 window filling the phase-2 window
    for _ in range(2):
        folder = distill_evals.probe_run(study, run, shape)
    assert folder == study.path / "claims" / f"probe-{KD}-seed0" and len(calls) == 1
    sources, _, config = calls[0]
    assert sources == [str(checkpoints["short"]), str(checkpoints["long"])]
    assert (config.block_len, config.repeats, config.modes) == (256, 8, PROBE_MODES)
    (study.path / "runs" / f"{KD}-seed1" / "result.json").unlink()  # no probe: its values are NaN
    study = StudyFolder(study.path)
    assert distill_evals.probe_run(study, study.seed_runs(KD)[1], shape) is None and len(calls) == 1


def test_the_teacher_retrieval_runs_once_at_the_study_lengths(tmp_path, monkeypatch):
    study = StudyFolder(write_runs(tmp_path, LOSSES, TAILS))
    (study.path / "claims" / "longctx-teacher" / "longctx.json").unlink()
    calls = []

    def fake_longctx(runs, folder, **options):
        calls.append((runs, options))
        write_json(Path(folder) / "longctx.json", {"runs": [{"tasks": {"passkey": {"cells": []}}}]})

    monkeypatch.setattr(distill_evals, "evaluate_longctx", fake_longctx)
    results = distill_evals.longctx_results(study)
    for _ in range(2):
        distill_evals.teacher_longctx(study, results)
    assert len(calls) == 1 and calls[0][0] == [TEACHER]
    assert calls[0][1]["tasks"] == ["passkey", NIAH] and calls[0][1]["lengths"] == [128, 1024]
    assert calls[0][1]["loss_windows"] == 0


def test_claims_name_their_seed_sections_and_the_shipped_study():
    assert list(CLAIMS) == ["kd-beats-ce", "theta-schedule", "probe-perturbation", "query-weights-band"]
    for claim in DISTILL_CLAIMS:
        assert claim.seed == "short-data-long-context (001)" and claim.section.startswith("Sec. ")
        assert claim.studies in {(s.study,) for s in SETTINGS} and (CLAIMS_CONFIGS / f"{claim.studies[0]}.yaml").is_file()


def test_the_shipped_smollm2_study_loads_and_expands():
    study = load_study(CLAIMS_CONFIGS / f"{STUDY}.yaml")
    runs = expand(study)
    assert study.teacher_cache and study.longctx is not None
    seeds: dict[str, set[int]] = {}
    for run in runs:
        seeds.setdefault(run.id.rsplit("-seed", 1)[0], set()).add(run.config.seed)
        assert run.config.distill.teacher == TEACHER and run.config.distill.top_k
        assert len(run.config.train.phases) == 2
        assert run.config.train.init_from == TEACHER  # students that already know language
    assert {KD, CE, *CONSTANT} <= set(seeds) and all(len(s) >= 2 for s in seeds.values())
