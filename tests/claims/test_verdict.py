"""The verdict rule on rigged measurements: each claim shape gives each verdict, one changed seed changes
it, and the rule survives relabelling and positive scaling (hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from ropelab.claims.verdict import (
    DOES_NOT_HOLD, FLOOR, HOLDS, INCONCLUSIVE, K, MIN_SEEDS, absent, all_hold, beats_beyond, higher, lower, matches,
    present, rises_sharply, rule_text,
)
from ropelab.config import ConfigError

LOW_BAND = {"rope10": [2.50, 2.51], "rope100": [2.49, 2.50]}


def test_rule_text_states_the_rule_with_its_constants():
    text = rule_text()
    assert "\n" not in text and text.startswith("A group is one configuration")
    assert f"k = {K:g} times" in text and f"fewer than {MIN_SEEDS} seeds" in text and f"floor of {FLOOR:g}" in text


# ------------------------------------------------------------------ band A higher than band B (RQ1-RQ5)


def test_band_higher_each_verdict_and_one_seed_decides():
    high = {"nope": [3.10, 3.12], "rope2ch": [3.00, 3.02]}
    assert higher(high, LOW_BAND).outcome == HOLDS  # gap 3.01 - 2.505 against 2 x 0.02
    noisy = high | {"rope2ch": [3.00, 2.40]}  # one seed moved: spread 0.6, the gap no longer counts
    assert higher(noisy, LOW_BAND).outcome == INCONCLUSIVE
    in_low_band = high | {"rope2ch": [2.40, 2.41]}  # two channels below the 10%+ band
    found = higher(in_low_band, LOW_BAND)
    assert found.outcome == DOES_NOT_HOLD and found.reason.startswith("rope2ch (2.405) against rope10 (2.505)")
    assert higher(high | {"nope": [3.1]}, LOW_BAND).outcome == INCONCLUSIVE  # one seed: no spread
    assert higher(high | {"nope": [3.1, math.nan]}, LOW_BAND).outcome == INCONCLUSIVE


def test_bad_bands_are_one_config_error():
    with pytest.raises(ConfigError, match="'rope10' is on both sides"):
        higher({"rope10": [1, 2]}, LOW_BAND)
    with pytest.raises(ConfigError, match="first band has no group"):
        higher({}, LOW_BAND)


# ------------------------------------------------------------------ metric rises sharply between fractions (RQ6)

SHARP = {0.0: [0.10, 0.12], 0.03: [0.11, 0.13], 0.1: [0.40, 0.41], 0.25: [0.42, 0.43], 1.0: [0.41, 0.42]}


def test_rises_sharply_each_verdict_and_one_seed_decides():
    assert rises_sharply(SHARP, 0.1).outcome == HOLDS
    assert rises_sharply(SHARP | {0.03: [0.11, 0.45]}, 0.1).outcome == INCONCLUSIVE  # one seed: spread 0.34
    gradual = {0.0: [0.10, 0.11], 0.03: [0.20, 0.21], 0.1: [0.30, 0.31], 0.25: [0.40, 0.41], 1.0: [0.50, 0.51]}
    found = rises_sharply(gradual, 0.1)  # the step counts but the fractions above it span more
    assert found.outcome == DOES_NOT_HOLD and "gradual" in found.reason
    assert rises_sharply(SHARP | {0.03: [0.60, 0.61]}, 0.1).outcome == DOES_NOT_HOLD  # a low fraction does best
    assert rises_sharply(SHARP, 0.5).outcome == INCONCLUSIVE  # the cut in the wrong place: no step at 0.5


def test_rises_sharply_in_perplexity_is_a_drop():
    perplexity = {f: [1 / v for v in values] for f, values in SHARP.items()}
    assert rises_sharply(perplexity, 0.1, higher_is_better=False).outcome == HOLDS
    assert rises_sharply(perplexity, 0.1).outcome == DOES_NOT_HOLD
    with pytest.raises(ConfigError, match="both sides of 2"):
        rises_sharply(SHARP, 2.0)


# ------------------------------------------------------------------ spike count lower with QK-Norm; perturbation smaller


def test_fewer_spikes_with_qk_norm():
    assert lower({"qk-norm": [0, 0]}, {"plain": [4, 3]}).outcome == HOLDS  # 3.5 against 2 x 1
    assert lower({"qk-norm": [0, 0]}, {"plain": [4, 0]}).outcome == INCONCLUSIVE  # one seed without spikes
    assert lower({"qk-norm": [5, 6]}, {"plain": [0, 1]}).outcome == DOES_NOT_HOLD


def test_perturbation_smaller_after_the_long_phase():
    assert lower({"after phase 2": [0.20, 0.22]}, {"after phase 1": [0.50, 0.52]}).outcome == HOLDS
    assert lower({"after phase 2": [0.20, 0.60]}, {"after phase 1": [0.50, 0.52]}).outcome == INCONCLUSIVE


# ------------------------------------------------------------------ A beats B beyond length L (KD vs CE, theta schedules)

POSITIONS = list(range(8))


def _curves(before: float, after: float, noise: float) -> list[list[float]]:
    return [[before] * 4 + [after + noise * seed] * 4 for seed in range(2)]


def test_beats_beyond_length_counts_only_the_positions_beyond():
    kd, ce = {"kd": _curves(4.0, 2.0, 0.01)}, {"ce": _curves(3.0, 2.5, 0.01)}
    assert beats_beyond(kd, ce, POSITIONS, 4).outcome == HOLDS
    assert beats_beyond(kd, ce, POSITIONS, 0).outcome == DOES_NOT_HOLD  # over every position KD is worse
    assert beats_beyond({"kd": _curves(4.0, 2.0, 0.3)}, ce, POSITIONS, 4).outcome == INCONCLUSIVE
    assert beats_beyond({"kd": _curves(4.0, 2.0, 0.01)[:1]}, ce, POSITIONS, 4).outcome == INCONCLUSIVE  # one seed


def test_phase_wise_theta_must_beat_both_constant_thetas():
    constants = {"theta 10k": _curves(3.0, 2.5, 0.01), "theta 500k": _curves(3.0, 2.2, 0.01)}
    assert beats_beyond({"10k -> 500k": _curves(3.0, 2.0, 0.01)}, constants, POSITIONS, 4).outcome == HOLDS
    assert beats_beyond({"10k -> 500k": _curves(3.0, 2.3, 0.01)}, constants, POSITIONS, 4).outcome == DOES_NOT_HOLD
    with pytest.raises(ConfigError, match="'theta 10k' has a curve of 7 values for 8 positions"):
        beats_beyond({"a": _curves(3, 2, 0)}, {"theta 10k": [[1.0] * 7, [1.0] * 7]}, POSITIONS, 4)
    with pytest.raises(ConfigError, match="no position at or beyond length 9"):
        beats_beyond({"a": _curves(3, 2, 0)}, constants, POSITIONS, 9)


# ------------------------------------------------------------------ perturbation present / absent (probe); groups match


def test_perturbation_present_and_absent():
    assert present([0.52, 0.40]).outcome == HOLDS and absent([0.52, 0.40]).outcome == DOES_NOT_HOLD
    assert present([0.0, 1e-9]).outcome == DOES_NOT_HOLD and absent([0.0, 1e-9]).outcome == HOLDS
    assert present([0.52, 0.0]).outcome == INCONCLUSIVE == absent([0.52, 0.0]).outcome
    assert present([0.52]).outcome == HOLDS  # a deterministic measure: one replica decides
    with pytest.raises(ConfigError, match="no perturbation measured"):
        absent([])


def test_groups_match():
    flat = {"rope10": [0.25, 0.27], "rope25": [0.26, 0.25], "rope100": [0.27, 0.26]}
    assert matches(flat).outcome == HOLDS
    assert matches(flat | {"rope10": [0.40, 0.41]}).outcome == DOES_NOT_HOLD
    assert matches(flat | {"rope10": [0.25]}).outcome == INCONCLUSIVE


def test_claims_taken_together():
    held, failed, unclear = higher({"a": [3, 3.1]}, {"b": [1, 1.1]}), higher({"a": [1, 1.1]}, {"b": [3, 3.1]}), present([1, 0])
    assert all_hold([held, held]).outcome == HOLDS
    assert all_hold([held, unclear]).outcome == INCONCLUSIVE
    assert all_hold([held, unclear, failed]) == failed


# ------------------------------------------------------------------ properties

# dyadic values, so that scaling by a power of two is exact; a group's seeds lie close to its centre
values = st.integers(-2**20, 2**20).map(lambda i: i / 1024)
offsets = st.lists(st.integers(-64, 64).map(lambda i: i / 1024), min_size=2, max_size=4)  # one seed: the rigged tests
seeds = st.builds(lambda centre, noise: [centre + o for o in noise], values, offsets)
bands = st.dictionaries(st.sampled_from("abcd"), seeds, min_size=1, max_size=3)
FLIPPED = {HOLDS: DOES_NOT_HOLD, DOES_NOT_HOLD: HOLDS, INCONCLUSIVE: INCONCLUSIVE}


@settings(max_examples=150, deadline=None)
@given(seeds, seeds)
def test_swapping_two_groups_flips_the_verdict(a, b):
    assert higher({"x": b}, {"y": a}).outcome == FLIPPED[higher({"x": a}, {"y": b}).outcome]


@settings(max_examples=150, deadline=None)
@given(bands, bands)
def test_a_band_that_holds_does_not_hold_the_other_way(high, low):
    low = {name.upper(): group for name, group in low.items()}
    if higher(high, low).outcome == HOLDS:
        assert higher(low, high).outcome == DOES_NOT_HOLD


@settings(max_examples=150, deadline=None)
@given(bands, bands, st.integers(-20, 20), st.integers(1, 7))
def test_scaling_every_value_keeps_every_verdict(high, low, power, length):
    low = {name.upper(): group for name, group in low.items()}
    scale = lambda band: {n: [v * 2.0**power for v in g] for n, g in band.items()}  # noqa: E731
    assert higher(scale(high), scale(low)).outcome == higher(high, low).outcome
    assert matches(scale(high | low)).outcome == matches(high | low).outcome
    by_fraction = {i / 4: group for i, group in enumerate([*high.values(), *low.values()])}
    if len(by_fraction) >= 2:
        assert rises_sharply(scale(by_fraction), 0.2).outcome == rises_sharply(by_fraction, 0.2).outcome
        flipped = rises_sharply(by_fraction, 0.2, higher_is_better=False).outcome
        assert flipped == DOES_NOT_HOLD or rises_sharply(by_fraction, 0.2).outcome != HOLDS
    curves = lambda band: {n: [[v] * 8 for v in g] for n, g in band.items()}  # noqa: E731
    assert (beats_beyond(curves(scale(high)), curves(scale(low)), POSITIONS, length).outcome
            == beats_beyond(curves(high), curves(low), POSITIONS, length).outcome)
