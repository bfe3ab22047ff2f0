"""The held-out check of a data law and the tail slope of a single run, on synthetic losses drawn from
known laws."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ropelab.config import ConfigError
from ropelab.study.fit import Point
from ropelab.study.fit_checks import held_out_check, held_out_checks, tail_slope
from scaling_points import BUDGETS, PARAMS, RESAMPLES, data_law, points


def test_held_out_prediction_holds_the_true_law_and_flags_a_largest_budget_off_it():
    on_law = held_out_check(points(), resamples=RESAMPLES)
    assert on_law.tokens == BUDGETS[-1] and on_law.fitted_up_to == BUDGETS[-3] and on_law.n_measured == 2
    assert on_law.inside and on_law.predicted.contains(float(data_law(BUDGETS[-1])))
    assert "inside the interval" in str(on_law) and "\n" not in str(on_law)
    off = [Point(p.variant, p.seed, p.params, p.tokens, p.loss + (0.3 if p.tokens == BUDGETS[-1] else 0.0))
           for p in points()]
    check = held_out_check(off, resamples=RESAMPLES)
    assert not check.inside and check.predicted == on_law.predicted and "OUTSIDE the interval" in str(check)


def test_held_out_checks_of_every_size_at_once():
    short = [p for p in points("short") if p.tokens >= BUDGETS[-4]]  # 2 budgets up to half the largest
    checks = held_out_checks(points("rope") + short, resamples=RESAMPLES)
    assert checks["rope", PARAMS] == held_out_check(points("rope"), resamples=RESAMPLES)
    assert "needs at least 3 distinct token budgets" in str(checks["short", PARAMS])


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


def test_bad_points_and_too_short_curves_are_refused():
    with pytest.raises(ConfigError, match="the held-out check .* needs at least 3 distinct token budgets"):
        held_out_check([p for p in points() if p.tokens >= BUDGETS[-4]])
    with pytest.raises(ConfigError, match="the last quarter of the run holds 2 evaluations"):
        tail_slope([1e5, 1e6, 8e6, 1e7], [3.0, 2.5, 2.1, 2.0])
    with pytest.raises(ConfigError, match="takes the points of one variant and one model size"):
        held_out_check(points("a") + points("b"))
