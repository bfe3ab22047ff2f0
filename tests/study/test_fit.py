"""The scaling laws and their fit on synthetic losses drawn from known laws: recovery, noise-free
curves, E on its bound, bad input."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ropelab.config import ConfigError
from ropelab.study.fit import fit_data_law, fit_joint_law
from scaling_points import B, BETA, BUDGETS, data_law, joint_law, points


@settings(max_examples=10, deadline=None)
@given(e=st.floats(1.0, 3.0), b=st.floats(5.0, 200.0), beta=st.floats(0.15, 0.6))
def test_noise_free_curves_are_fitted_exactly(e, b, beta):
    law = fit_data_law(BUDGETS, e + b * BUDGETS ** -beta)
    np.testing.assert_allclose(law.predict(BUDGETS), e + b * BUDGETS ** -beta, rtol=1e-6)


def test_a_pure_power_law_is_fitted_with_E_on_its_bound():
    # the optimum lies at E -> 0: E is bounded at 0 (not log E), so the fit lands there instead of crawling
    law = fit_data_law(BUDGETS, B * BUDGETS ** -BETA)
    assert law.E == 0.0 and law.beta == pytest.approx(BETA, rel=1e-5) and law.B == pytest.approx(B, rel=1e-4)


def test_joint_law_needs_three_sizes():
    two = points(sizes=(1e5, 1e6), law=joint_law)
    with pytest.raises(ConfigError, match="L\\(N, D\\) needs at least 3 model sizes, got 2"):
        fit_joint_law([p.params for p in two], [p.tokens for p in two], [p.loss for p in two])


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
