"""Scaling-law fits on synthetic losses drawn from known laws: recovery, bootstrap intervals, the
held-out check, gaps between variants (one set of resamples for fits and gaps), the tail slope of a single run,
bad input, the report section."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ropelab.config import ConfigError
from ropelab.study.fit import (Point, bootstrap, fit_data_law, fit_gaps, fit_joint_law, fit_variants, gap,
                               held_out_check, held_out_checks, tail_slope)
from ropelab.study.fit_report import FIGURE_NAME, fit_section

E, A, ALPHA, B, BETA = 1.8, 50.0, 0.35, 30.0, 0.3
BUDGETS = np.geomspace(1e5, 1e7, 8)
PARAMS = 1e5
NOISE = 0.002  # multiplicative, 0.2 %
RESAMPLES = 200


def data_law(tokens, offset: float = 0.0):
    return E + offset + B * np.asarray(tokens) ** -BETA


def joint_law(params, tokens):
    return E + A * np.asarray(params) ** -ALPHA + B * np.asarray(tokens) ** -BETA


def points(variant: str = "rope", offset: float = 0.0, seeds=(0, 1), sizes=(PARAMS,), noise_seed: int = 0,
           law=None) -> list[Point]:
    rng = np.random.default_rng(noise_seed)
    law = law or (lambda n, d: data_law(d, offset))
    return [Point(variant, seed, n, float(d), float(law(n, d) * math.exp(NOISE * rng.standard_normal())))
            for seed in seeds for n in sizes for d in BUDGETS]


@pytest.fixture(scope="module")
def rope_fit():
    return fit_variants(points(), resamples=RESAMPLES)[0]


def test_data_law_recovers_known_parameters_within_its_intervals(rope_fit):
    (size,) = rope_fit.sizes
    assert size.law.E == pytest.approx(E, abs=0.03) and size.law.beta == pytest.approx(BETA, abs=0.02)
    assert size.n_budgets == 8 and size.law.n_points == 16 and rope_fit.joint is None
    assert size.estimates["E"].contains(E) and size.estimates["beta"].contains(BETA)
    at_20 = size.estimates["loss at 20 tokens/param"]
    assert at_20.contains(float(data_law(20 * PARAMS))) and at_20.high - at_20.low < 0.02


def test_bootstrap_is_deterministic_for_a_seed(rope_fit):
    again = fit_variants(points(), resamples=RESAMPLES)[0]
    assert again.sizes[0].estimates == rope_fit.sizes[0].estimates


@settings(max_examples=10, deadline=None)
@given(e=st.floats(1.0, 3.0), b=st.floats(5.0, 200.0), beta=st.floats(0.15, 0.6))
def test_noise_free_curves_are_fitted_exactly(e, b, beta):
    law = fit_data_law(BUDGETS, e + b * BUDGETS ** -beta)
    np.testing.assert_allclose(law.predict(BUDGETS), e + b * BUDGETS ** -beta, rtol=1e-6)


def test_joint_law_recovers_known_parameters():
    sizes = (1e5, 1e6, 1e7)
    # 95 % intervals: about one noise draw in twelve has one of the three just outside (seed 0: alpha)
    fit = fit_variants(points(sizes=sizes, law=joint_law, noise_seed=1), resamples=100)[0]
    assert [s.params for s in fit.sizes] == list(sizes)
    law = fit.joint
    assert law.E == pytest.approx(E, abs=0.05) and law.alpha == pytest.approx(ALPHA, abs=0.03)
    assert law.beta == pytest.approx(BETA, abs=0.03)
    for key, true in (("E", E), ("alpha", ALPHA), ("beta", BETA)):
        assert fit.joint_estimates[key].contains(true), key
    assert law.predict(1e6, 2e7) == pytest.approx(joint_law(1e6, 2e7), rel=2e-3)


def test_a_pure_power_law_is_fitted_with_E_on_its_bound():
    # the optimum lies at E -> 0: E is bounded at 0 (not log E), so the fit lands there instead of crawling
    law = fit_data_law(BUDGETS, B * BUDGETS ** -BETA)
    assert law.E == 0.0 and law.beta == pytest.approx(BETA, rel=1e-5) and law.B == pytest.approx(B, rel=1e-4)


def test_joint_law_needs_three_sizes():
    two = points(sizes=(1e5, 1e6), law=joint_law)
    with pytest.raises(ConfigError, match="L\\(N, D\\) needs at least 3 model sizes, got 2"):
        fit_joint_law([p.params for p in two], [p.tokens for p in two], [p.loss for p in two])


def test_held_out_prediction_holds_the_true_law_and_flags_a_largest_budget_off_it():
    on_law = held_out_check(points(), resamples=RESAMPLES)
    assert on_law.tokens == BUDGETS[-1] and on_law.fitted_up_to == BUDGETS[-3] and on_law.n_measured == 2
    assert on_law.inside and on_law.predicted.contains(float(data_law(BUDGETS[-1])))
    assert "inside the interval" in str(on_law) and "\n" not in str(on_law)
    off = [Point(p.variant, p.seed, p.params, p.tokens, p.loss + (0.3 if p.tokens == BUDGETS[-1] else 0.0))
           for p in points()]
    check = held_out_check(off, resamples=RESAMPLES)
    assert not check.inside and check.predicted == on_law.predicted and "OUTSIDE the interval" in str(check)


def test_gap_between_variants_holds_the_true_gap():
    both = points("rope") + points("nope", offset=0.05, noise_seed=1)
    (result,) = gap(both, "rope", "nope", resamples=RESAMPLES)
    assert (result.a, result.b, result.budget, result.tokens) == ("rope", "nope", "20 tokens/param", 20 * PARAMS)
    assert result.estimate.contains(-0.05) and result.estimate.high < 0


def test_one_set_of_resamples_serves_the_fits_and_the_gaps():
    both = points("rope") + points("nope", offset=0.05, noise_seed=1)
    fits = fit_variants(both + points("yarn", offset=0.02, noise_seed=2), resamples=RESAMPLES)
    # a variant's intervals do not depend on the other variants fitted with it
    assert fits[0].sizes[0].estimates == fit_variants(points("rope"), resamples=RESAMPLES)[0].sizes[0].estimates
    (size,) = fits[1].sizes
    assert size.samples["beta"].shape == (RESAMPLES,)
    assert size.estimates["beta"].low == pytest.approx(np.percentile(size.samples["beta"], 2.5))
    (from_fits,) = fit_gaps(fits, "nope", "rope")
    assert [from_fits] == gap(both, "nope", "rope", resamples=RESAMPLES)
    assert from_fits.estimate.contains(0.05)


def test_held_out_checks_of_every_size_at_once():
    short = [p for p in points("short") if p.tokens >= BUDGETS[-4]]  # 2 budgets up to half the largest
    checks = held_out_checks(points("rope") + short, resamples=RESAMPLES)
    assert checks["rope", PARAMS] == held_out_check(points("rope"), resamples=RESAMPLES)
    assert "needs at least 3 distinct token budgets" in str(checks["short", PARAMS])


def test_bootstrap_resamples_whole_seeds():
    # every point of a seed has the same loss: the spread comes from drawing seeds, not points
    flat = [Point("v", seed, PARAMS, float(d), 1.0 + seed) for seed in (0, 1) for d in BUDGETS]
    mean = bootstrap(flat, lambda pts: {"mean": float(np.mean([p.loss for p in pts]))}, resamples=100)["mean"]
    assert (mean.value, mean.low, mean.high) == (1.5, 1.0, 2.0)


def test_variants_with_the_same_seeds_are_resampled_in_pairs():
    paired = [Point(v, seed, PARAMS, float(d), 1.0 + seed + (0.1 if v == "b" else 0.0))
              for v in ("a", "b") for seed in (0, 1) for d in BUDGETS]

    def difference(pts):
        return {"gap": float(np.mean([p.loss for p in pts if p.variant == "b"])
                             - np.mean([p.loss for p in pts if p.variant == "a"]))}

    estimate = bootstrap(paired, difference, resamples=100)["gap"]
    assert estimate.low == pytest.approx(0.1) and estimate.high == pytest.approx(0.1)


def test_tail_slope_flags_a_falling_curve_and_not_a_flat_noisy_one():
    rng = np.random.default_rng(0)
    tokens = np.linspace(1e6, 1e8, 200)
    falling = tail_slope(tokens, data_law(tokens) + rng.normal(0, 1e-3, tokens.size))
    assert falling.still_falling and falling.slope < 0 and falling.n_points == 51
    assert falling.noise == pytest.approx(2 * falling.stderr)
    flat = tail_slope(tokens, 3.0 + rng.normal(0, 0.02, tokens.size))
    assert not flat.still_falling and abs(flat.slope) < flat.noise
    # a slope smaller than the seed spread is not "still falling"
    assert not tail_slope(tokens, data_law(tokens), noise=abs(falling.slope) * 2).still_falling


@settings(max_examples=30, deadline=None)
@given(slope=st.floats(-0.5, 0.5), level=st.floats(1.0, 10.0))
def test_tail_slope_of_a_straight_line_in_log_tokens_is_its_slope(slope, level):
    tokens = np.linspace(1e7, 1e9, 60)  # log2 from -6.6 to 0 below 1e9: the loss stays above 1 - 0.5 * 6.6 + 4
    result = tail_slope(tokens, level + 4.0 + slope * np.log2(tokens / 1e9))
    assert result.slope == pytest.approx(slope, abs=1e-9)


@pytest.mark.parametrize("tokens, losses, message", [
    ([1e5, 1e6, 1e5, 1e6], [3.0, 2.5, 3.0, 2.5], "needs at least 3 distinct token budgets, got 2"),
    ([1e5, 1e6, 1e7], [3.0, float("nan"), 2.0], "loss must be finite and positive, got nan at index 1"),
    ([1e5, -1e6, 1e7], [3.0, 2.5, 2.0], "tokens must be finite and positive, got -1000000.0 at index 1"),
    ([1e5, 1e6, 1e7], [3.0, 0.0, 2.0], "loss must be finite and positive, got 0.0 at index 1"),
    ([1e5, 1e6, 1e7], [3.0, 2.5], "3 token counts for 2 losses"),
])
def test_bad_input_is_refused_in_one_line(tokens, losses, message):
    with pytest.raises(ConfigError, match=message) as raised:
        fit_data_law(tokens, losses)
    assert "\n" not in str(raised.value)


@settings(max_examples=25, deadline=None)
@given(bad=st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -1.0]), index=st.integers(0, 7),
       in_tokens=st.booleans())
def test_any_value_that_is_not_finite_and_positive_is_named(bad, index, in_tokens):
    tokens, losses = list(BUDGETS), list(data_law(BUDGETS))
    (tokens if in_tokens else losses)[index] = bad
    what = "tokens" if in_tokens else "loss"
    with pytest.raises(ConfigError, match=f"{what} must be finite and positive, got .* at index {index}$"):
        fit_data_law(tokens, losses)


def test_bad_points_and_too_short_curves_are_refused():
    with pytest.raises(ConfigError, match="the held-out check .* needs at least 3 distinct token budgets"):
        held_out_check([p for p in points() if p.tokens >= BUDGETS[-4]])
    with pytest.raises(ConfigError, match="params must be finite and positive"):
        fit_variants([Point("v", 0, float("inf"), float(d), 2.0) for d in BUDGETS])
    with pytest.raises(ConfigError, match="the last quarter of the run holds 2 evaluations"):
        tail_slope([1e5, 1e6, 8e6, 1e7], [3.0, 2.5, 2.1, 2.0])
    with pytest.raises(ConfigError, match="no points"):
        fit_variants([])
    with pytest.raises(ConfigError, match="takes the points of one variant and one model size"):
        held_out_check(points("a") + points("b"))
    with pytest.raises(ConfigError, match="variants 'a' and 'b' have no model size in common"):
        gap(points("a") + points("b", sizes=(1e6,)), "a", "b")


def test_fit_section_has_tables_a_figure_and_a_held_out_line_per_variant():
    both = points("rope") + points("nope", offset=0.05, noise_seed=1) + [Point("short", 0, PARAMS, 1e5, 3.0)]
    section = fit_section(both, resamples=50)
    assert section.title == "Scaling-law fits" and section.images[FIGURE_NAME].startswith(b"\x89PNG")
    assert "| rope | 1e+05 | 8 | 16 |" in section.markdown
    assert "| nope - rope | 1e+05 | 20 tokens/param |" in section.markdown
    assert section.markdown.count("held-out check") == 2
    assert "not fitted (fewer than 3 budgets): short N=1e+05" in section.markdown
    assert "<table>" in section.html and f"![scaling fit]({FIGURE_NAME})" in section.markdown


def test_fit_section_is_absent_without_three_budgets():
    assert fit_section([p for p in points() if p.tokens >= BUDGETS[-2]]) is None
