"""Verdicts on loss frontiers on rigged measurements: each claim gives each verdict, the reasons carry the
deciding figures, bad shapes are one ConfigError, and the rule survives relabelling and positive scaling
(hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from ropelab.claims.frontier_verdict import frontier_higher, frontier_matches, gap_trend
from ropelab.claims.verdict import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, K, RESAMPLES, rule_text
from ropelab.config import ConfigError

# dyadic losses, so that differences are exact: a constant gap has a slope of exactly zero
BUDGETS = (1e6, 2e6, 4e6, 8e6)
BASE = (2.5, 2.25, 2.125, 2.0)
B_OFFSETS, A_OFFSETS = (0.0, 1 / 128), (0.0, 1 / 256)  # the noise at every budget: the range 1/128 of B's seeds


def _frontier(losses, offsets=B_OFFSETS) -> dict[float, list[float]]:
    return {budget: [loss + offset for offset in offsets] for budget, loss in zip(BUDGETS, losses)}


def _above_base(gaps, offsets=A_OFFSETS) -> dict[float, list[float]]:
    """A frontier `gaps` above BASE at the budgets (the seeds' gaps then differ by 1/256)."""
    return _frontier([loss + gap for loss, gap in zip(BASE, gaps)], offsets)


ROPE100 = _frontier(BASE)
CONSTANT = _above_base((0.25,) * 4)
SHRINKING = _above_base((1.0, 0.75, 0.5, 0.25))  # 0.25 per doubling, still 0.248 at 8e6 tokens
CLOSED = _above_base((0.25, 0.125, 0.0625, 0.0))  # the mean gap at 8e6 tokens is -1/512: closed, noise below zero
OPENING = _above_base((0.0, 1 / 256, 1 / 128, 3 / 256))  # within the noise at 8e6 tokens, growing 1/256 per doubling


def test_rule_text_states_the_frontier_rule():
    text = rule_text()
    assert "\n" not in text and text.startswith("A group is one configuration")
    assert "A frontier is one configuration's final validation loss" in text
    assert "per doubling of tokens" in text and f"{RESAMPLES} resamples" in text


# ------------------------------------------------------------------ the figures


def test_gap_trend_figures():
    trend = gap_trend(SHRINKING, ROPE100)
    assert trend.budgets == BUDGETS and trend.gaps[1e6] == (1.0, 1.0 - 1 / 256)
    assert trend.final_gaps == (0.25, 0.25 - 1 / 256) and trend.final_gap == 0.25 - 1 / 512
    assert trend.noise == 1 / 128 and trend.slope == -0.25 and trend.slope_interval == (-0.25, -0.25)
    doublings_left = (trend.final_gap - K / 128) / 0.25
    assert trend.within_noise_at == pytest.approx(8e6 * 2**doublings_left)
    assert trend.counts and trend.shrinks and not trend.grows
    assert gap_trend(SHRINKING, ROPE100) == trend  # the bootstrap has a fixed seed


def test_two_seeds_at_two_budgets_span_the_seeds_slopes():
    a, b = {1e6: [3.0, 3.0], 4e6: [2.5, 2.7]}, {1e6: [2.0, 2.0], 4e6: [2.0, 2.0]}
    trend = gap_trend(a, b)  # seed 0 closes 0.5 in 2 doublings, seed 1 closes 0.3
    assert trend.slope == pytest.approx(-0.2) and trend.slope_interval == pytest.approx((-0.25, -0.15))


def test_within_noise_at():
    assert gap_trend(CLOSED, ROPE100).within_noise_at == 8e6  # already within
    assert gap_trend(CONSTANT, ROPE100).within_noise_at is None  # a flat gap never closes
    assert gap_trend(_above_base((0.3, 0.2, 0.25, 0.75)), ROPE100).within_noise_at is None  # a widening gap
    slow = _above_base((2.0, 2.0 - 2**-40, 2.0 - 2**-39, 2.0 - 3 * 2**-40))
    assert gap_trend(slow, ROPE100).within_noise_at == math.inf  # beyond any float


# ------------------------------------------------------------------ A matches B


def test_frontier_matches_each_verdict():
    closed = frontier_matches({"rope10": CLOSED}, {"rope100": ROPE100})
    assert closed.outcome == HOLDS
    assert closed.reason == "rope10 against rope100: gap -0.001953 at 8e+06 tokens (per seed 0, -0.003906) against " \
                            "2 x noise 0.007812, slope -0.08125 [-0.125, -0.0625] per doubling"
    assert frontier_matches({"rope10": CONSTANT}, {"rope100": ROPE100}).outcome == DOES_NOT_HOLD
    shrinking = frontier_matches({"rope10": SHRINKING}, {"rope100": ROPE100})
    assert shrinking.outcome == INCONCLUSIVE
    assert shrinking.reason.endswith("slope -0.25 [-0.25, -0.25] per doubling; "
                                     "at the fitted slope the gap would fall within the noise at 1.524e+07 tokens")
    opening = frontier_matches({"rope10": OPENING}, {"rope100": ROPE100})
    assert opening.outcome == INCONCLUSIVE and opening.reason.endswith("within the noise at the largest budget, but growing")


def test_frontier_matches_on_one_seed_moved():
    noisy = CONSTANT | {8e6: [2.25, 1.75]}  # one seed at the largest budget: the noise swallows the gap
    assert frontier_matches({"rope10": noisy}, {"rope100": ROPE100}).outcome == HOLDS


# ------------------------------------------------------------------ A is higher than B


def test_frontier_higher_each_verdict():
    assert frontier_higher({"nope": CONSTANT}, {"rope100": ROPE100}).outcome == HOLDS
    assert frontier_higher({"nope": _above_base((0.25, 0.5, 0.75, 1.0))}, {"rope100": ROPE100}).outcome == HOLDS
    assert frontier_higher({"rope100": ROPE100}, {"nope": CONSTANT}).outcome == DOES_NOT_HOLD
    shrinking = frontier_higher({"nope": SHRINKING}, {"rope100": ROPE100})
    assert shrinking.outcome == INCONCLUSIVE and shrinking.reason.endswith("within the noise at 1.524e+07 tokens")
    catching_up = frontier_higher({"rope100": ROPE100}, {"nope": SHRINKING})  # B higher but closing: the mirror
    assert catching_up.outcome == INCONCLUSIVE and catching_up.reason.endswith("within the noise at 1.524e+07 tokens")
    closed = frontier_higher({"nope": CLOSED}, {"rope100": ROPE100})
    assert closed.outcome == INCONCLUSIVE and closed.reason.endswith("; within the noise at the largest budget")


def test_frontier_bands_judge_every_pair():
    high = {"nope": _above_base((0.5,) * 4), "rope2ch": CONSTANT}
    low = {"rope10": _frontier([loss + 1 / 256 for loss in BASE]), "rope100": ROPE100}
    held = frontier_higher(high, low)
    assert held.outcome == HOLDS and held.reason.count(": gap ") == 4
    shrinking = frontier_higher(high | {"rope2ch": SHRINKING}, low)
    assert shrinking.outcome == INCONCLUSIVE and shrinking.reason.startswith("rope2ch against rope10:")
    below = frontier_higher(high | {"rope2ch": _above_base((-0.25,) * 4)}, low)
    assert below.outcome == DOES_NOT_HOLD and below.reason.count(": gap ") == 2  # the pairs that decided it
    assert frontier_matches({"rope10": CLOSED, "rope25": _above_base((0.0,) * 4)}, {"rope100": ROPE100}).outcome == HOLDS


# ------------------------------------------------------------------ unusable values and bad shapes


def test_too_few_seeds_or_a_value_not_finite_is_inconclusive():
    one_seed = _above_base((0.25,) * 4, offsets=(0.0,))
    found = frontier_higher({"nope": one_seed}, {"rope100": ROPE100})
    assert found.outcome == INCONCLUSIVE and found.reason.startswith("nope at 1e+06 tokens: 1 seed(s)")
    found = frontier_matches({"rope10": CONSTANT}, {"rope100": ROPE100 | {8e6: [2.0, math.nan]}})
    assert found.outcome == INCONCLUSIVE and found.reason.startswith("rope100 at 8e+06 tokens: a value is not finite")
    assert frontier_higher({"nope": CONSTANT | {2e6: [math.inf, 2.5]}}, {"rope100": ROPE100}).outcome == INCONCLUSIVE


@pytest.mark.parametrize("frontier, message", [
    ({1e6: [2.0, 2.1], 2e6: [1.9, 2.0], 4e6: [1.8, 1.9], 16e6: [1.7, 1.8]}, r"different budgets: 1e\+06, 2e\+06, 4e\+06, 1.6e\+07 against"),
    ({8e6: [2.0, 2.1]}, "different budgets"),
    ({1e6: [2.0, 2.1, 2.2], 2e6: [1.9, 2.0, 2.1], 4e6: [1.8, 1.9, 2.0], 8e6: [1.7, 1.8, 1.9]}, "groups of 2 and 3 seeds"),
])
def test_bad_frontiers_are_one_config_error_naming_the_pair(frontier, message):
    for claim in (frontier_higher, frontier_matches):
        with pytest.raises(ConfigError, match=message + r".*\(nope against rope100\)"):
            claim({"nope": frontier}, {"rope100": ROPE100})


def test_bad_budgets_and_bands_are_config_errors():
    with pytest.raises(ConfigError, match="at least 2"):
        frontier_matches({"a": {1e6: [2.0, 2.1]}}, {"b": {1e6: [2.0, 2.1]}})
    with pytest.raises(ConfigError, match="budget -1.0: a budget is a positive number"):
        frontier_matches({"a": {-1.0: [2.0, 2.1], 1e6: [2.0, 2.1]}}, {"b": {-1.0: [2.0, 2.1], 1e6: [2.0, 2.1]}})
    with pytest.raises(ConfigError, match="different budgets"):  # a wrong shape before an unusable value
        frontier_higher({"a": {1e6: [math.nan], 2e6: [2.0]}}, {"b": {1e6: [2.0], 4e6: [2.0]}})
    with pytest.raises(ConfigError, match="'rope100' is on both sides"):
        frontier_higher({"rope100": CONSTANT}, {"rope100": ROPE100})
    with pytest.raises(ConfigError, match="second band has no group"):
        frontier_matches({"rope10": CONSTANT}, {})
    with pytest.raises(ConfigError, match="different budgets"):
        gap_trend(CONSTANT, {1e6: [2.0, 2.1]})


def test_scaling_the_losses_by_any_positive_constant_keeps_the_verdicts():
    scale = lambda frontier: {budget: [3.7 * v for v in values] for budget, values in frontier.items()}  # noqa: E731
    for a in (SHRINKING, CLOSED, OPENING, _above_base((0.25, 0.5, 0.75, 1.0))):
        for claim in (frontier_higher, frontier_matches):
            assert claim({"a": scale(a)}, {"b": scale(ROPE100)}).outcome == claim({"a": a}, {"b": ROPE100}).outcome
    assert gap_trend(scale(SHRINKING), scale(ROPE100)).within_noise_at == pytest.approx(gap_trend(SHRINKING, ROPE100).within_noise_at)


# ------------------------------------------------------------------ properties

FLIPPED = {HOLDS: DOES_NOT_HOLD, DOES_NOT_HOLD: HOLDS, INCONCLUSIVE: INCONCLUSIVE}
dyadic = lambda low, high, unit: st.integers(low, high).map(lambda i: i / unit)  # noqa: E731


@st.composite
def frontiers(draw, count: int = 2) -> list[dict[float, list[float]]]:
    """`count` frontiers over the same 2-4 budgets and 2-3 seeds, each a drawn gap above a common loss; dyadic values."""
    budgets = draw(st.lists(st.integers(1, 2**30).map(float), min_size=2, max_size=4, unique=True))
    seeds = draw(st.integers(2, 3))
    drawn = [{} for _ in range(count)]
    for budget in budgets:
        loss = draw(dyadic(1024, 8192, 1024))
        for frontier in drawn:
            gap = draw(dyadic(-64, 64, 64))
            frontier[budget] = [loss + gap + draw(dyadic(-16, 16, 1024)) for _ in range(seeds)]
    return drawn


@settings(max_examples=150, deadline=None)
@given(frontiers())
def test_relabelling_flips_higher_and_keeps_matches(pair):
    a, b = pair
    assert frontier_higher({"y": b}, {"x": a}).outcome == FLIPPED[frontier_higher({"x": a}, {"y": b}).outcome]
    assert frontier_matches({"y": b}, {"x": a}).outcome == frontier_matches({"x": a}, {"y": b}).outcome
    forward, backward = gap_trend(a, b), gap_trend(b, a)
    assert backward.slope == -forward.slope and backward.slope_interval == tuple(-s for s in reversed(forward.slope_interval))
    assert backward.within_noise_at == forward.within_noise_at


@settings(max_examples=100, deadline=None)
@given(frontiers(count=4))
def test_bands_that_hold_do_not_hold_the_other_way(four):
    high, low = {"a": four[0], "b": four[1]}, {"C": four[2], "D": four[3]}
    if frontier_higher(high, low).outcome == HOLDS:
        assert frontier_higher(low, high).outcome == DOES_NOT_HOLD


@settings(max_examples=150, deadline=None)
@given(frontiers(), st.integers(-20, 20))
def test_scaling_by_a_power_of_two_keeps_every_verdict(pair, power):
    scale = lambda frontier: {budget: [v * 2.0**power for v in values] for budget, values in frontier.items()}  # noqa: E731
    a, b = pair
    for claim in (frontier_higher, frontier_matches):
        assert claim({"x": scale(a)}, {"y": scale(b)}).outcome == claim({"x": a}, {"y": b}).outcome
