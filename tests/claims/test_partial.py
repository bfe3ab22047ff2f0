"""The partial-RoPE claims judged on rigged study folders (a config.yaml, a loss curve and a final
validation loss per run, as the study runner writes them): bands that separate give `holds`, bands
in the wrong order give `does not hold`, and every shipped claim study config loads and expands."""

from __future__ import annotations

import numpy as np
import pytest

from ropelab.claims.paths import CLAIMS_CONFIGS
from ropelab.claims.partial import PARTIAL_CLAIMS
from ropelab.claims.verdict import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE
from ropelab.study.grid import expand, load_study
from tests.claims.rigged import write_run, write_study

CLAIMS = {claim.id: claim for claim in PARTIAL_CLAIMS}
SEPARATED = {"nope": 3.0, "2ch": 2.95, "rope10": 2.50, "rope25": 2.50, "rope100": 2.49}


def test_rq1_holds_when_the_bands_separate_and_fails_when_two_channels_join_the_low_band(tmp_path):
    holds = CLAIMS["rq1"].judge({"partial-stdlib": write_study(tmp_path / "a", SEPARATED)})
    assert holds.verdict.outcome == HOLDS and holds.figure.startswith(b"\x89PNG")
    assert [row[1] for row in holds.table[1]] == [HOLDS, HOLDS]
    joined = CLAIMS["rq1"].judge({"partial-stdlib": write_study(tmp_path / "b", SEPARATED | {"2ch": 2.2})})
    assert joined.verdict.outcome == DOES_NOT_HOLD and "2ch" in joined.verdict.reason


def test_rq1_is_inconclusive_when_the_seeds_disagree_more_than_the_bands(tmp_path):
    found = CLAIMS["rq1"].judge({"partial-stdlib": write_study(tmp_path, SEPARATED, spread=0.5)})
    assert found.verdict.outcome == INCONCLUSIVE


def test_rq4_reads_nope_alone_above_two_channels(tmp_path):
    pythia = {"nope": 3.3, "2ch": 2.9, "rope10": 2.5, "rope100": 2.5}
    assert CLAIMS["rq4"].judge({"partial-pythia": write_study(tmp_path / "a", pythia)}).verdict.outcome == HOLDS
    below = pythia | {"nope": 2.7}  # NoPE converges below two channels: not "fails to converge"
    assert CLAIMS["rq4"].judge({"partial-pythia": write_study(tmp_path / "b", below)}).verdict.outcome == DOES_NOT_HOLD
    level = pythia | {"nope": 2.9}  # level with two channels: neither
    assert CLAIMS["rq4"].judge({"partial-pythia": write_study(tmp_path / "c", level)}).verdict.outcome == INCONCLUSIVE


def test_rq3_needs_the_drift_of_ten_percent_to_grow_with_length(tmp_path):
    stdlib = write_study(tmp_path / "stdlib", SEPARATED)
    lengths = {}
    for length, drift in ((128, 0.0), (512, 0.3)):
        lengths |= {f"nope-len{length}": 3.0, f"rope10-len{length}": 2.5 + drift, f"rope25-len{length}": 2.5,
                    f"rope100-len{length}": 2.49}
    found = CLAIMS["rq3"].judge({"partial-lengths": write_study(tmp_path / "lengths", lengths), "partial-stdlib": stdlib})
    drift_part = found.table[1][-1]
    assert drift_part[1] == HOLDS and "gap at 512" in drift_part[0]
    assert found.verdict.outcome == DOES_NOT_HOLD  # with a drift of 0.3, 10 % no longer matches full RoPE at 512


def test_spikes_hold_only_when_nope_spikes_and_qk_norm_does_not(tmp_path):
    calm = 2.0 + 0.01 * np.random.default_rng(0).standard_normal(100)
    spiky = calm.copy()
    spiky[40:44] = spiky[70:74] = 9.0  # the detector counts a spike that lasts 3 points or more
    study = tmp_path / "spikes"
    for seed in (0, 1):
        write_run(study, f"nope-seed{seed}", 2.0, spiky)
        write_run(study, f"nope-qknorm-seed{seed}", 2.0, calm)
    found = CLAIMS["spikes"].judge({"partial-spikes": study})
    assert found.verdict.outcome == HOLDS, found.table
    calm_study = tmp_path / "calm"
    for seed in (0, 1):
        write_run(calm_study, f"nope-seed{seed}", 2.0, calm)
        write_run(calm_study, f"nope-qknorm-seed{seed}", 2.0, calm)
    assert CLAIMS["spikes"].judge({"partial-spikes": calm_study}).verdict.outcome == DOES_NOT_HOLD


def test_a_missing_variant_is_named(tmp_path):
    from ropelab.config import ConfigError

    with pytest.raises(ConfigError, match="no run of variant 'rope10'"):
        CLAIMS["rq1"].judge({"partial-stdlib": write_study(tmp_path, {k: v for k, v in SEPARATED.items() if k != "rope10"})})


@pytest.mark.parametrize("path", sorted(CLAIMS_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_claim_study_loads_and_expands(path):
    runs = expand(load_study(path))
    assert runs and all(run.config.train.steps > 0 for run in runs)


def test_every_study_a_claim_needs_is_shipped():
    from ropelab.claims.runner import CLAIMS as ALL

    shipped = {p.stem for p in CLAIMS_CONFIGS.glob("*.yaml")}
    assert {stem for claim in ALL for stem in claim.studies} <= shipped
