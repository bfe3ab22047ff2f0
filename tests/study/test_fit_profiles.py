"""Parameter profiles of the scaling laws and whether the data identify each parameter, on synthetic
losses drawn from known laws."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ropelab.study.fit import fit_data_law, fit_joint_law, fits_and_refits
from ropelab.study.fit_profiles import GRID_POINTS, law_profiles
from scaling_points import ALPHA, BETA, E, joint_law, points

SIZES = (1e5, 3e5, 1e6, 3e6, 1e7)


def _joint_fit(pts):
    """(log x, log loss, theta, objective) of the joint law fitted to the points."""
    params, tokens, losses = (np.array([getattr(p, k) for p in pts]) for k in ("params", "tokens", "loss"))
    law = fit_joint_law(params, tokens, losses)
    theta = np.array([law.E, np.log(law.A), law.alpha, np.log(law.B), law.beta])
    return np.log(np.column_stack([params, tokens])), np.log(losses), theta, law.objective


@pytest.fixture(scope="module")
def known_law_fit():
    return _joint_fit(points(sizes=SIZES, law=joint_law, noise_seed=1))


@pytest.fixture(scope="module")
def known_law_profiles(known_law_fit):
    return law_profiles(*known_law_fit)


def test_alpha_is_identified_and_its_interval_covers_the_truth(known_law_profiles):
    alpha = known_law_profiles["alpha"]
    assert alpha.identified and alpha.low < ALPHA < alpha.high
    assert alpha.values.size == GRID_POINTS and alpha.values[0] == 0.0
    assert np.all(alpha.objectives >= alpha.minimum * (1 - 1e-9))  # holding a parameter cannot fit better
    beta = known_law_profiles["beta"]
    assert beta.identified and beta.low < BETA < beta.high


def test_profile_rises_away_from_the_best_fit(known_law_profiles):
    alpha = known_law_profiles["alpha"]
    assert alpha.objectives[0] > alpha.threshold and alpha.objectives[-1] > alpha.threshold
    assert alpha.minimum <= alpha.threshold


def test_alpha_is_not_identified_from_a_flat_law():
    """L(N, D) with no N term: every alpha fits (A goes to 0), so its interval runs to the grid's ends."""
    flat = law_profiles(*_joint_fit(points(sizes=SIZES, law=lambda n, d: joint_law(1e12, d), noise_seed=1)))
    assert not flat["alpha"].identified
    assert all(np.all(np.diff(p.values) > 0) for p in flat.values())  # a best fit at 0 repeats no grid value


def test_one_size_identifies_no_size_exponent():
    """A data law knows nothing of alpha; from one size the joint law cannot be fitted at all, and a
    data law's beta is still identified from its budgets."""
    pts = points(noise_seed=1)
    tokens, losses = np.array([p.tokens for p in pts]), np.array([p.loss for p in pts])
    law = fit_data_law(tokens, losses)
    profiles = law_profiles(np.log(tokens)[:, None], np.log(losses), np.array([law.E, np.log(law.B), law.beta]),
                            law.objective)
    assert set(profiles) == {"E", "beta"} and profiles["beta"].identified


@pytest.mark.parametrize("sizes", [(1e6,), (1e5, 1e7)], ids=["one size", "two sizes"])
def test_too_few_sizes_leave_alpha_unidentified(sizes):
    """With one or two sizes, E, A and alpha share one or two levels: the joint law (fitted here without
    `fit_joint_law`'s refusal of fewer than 3 sizes) cannot pin alpha down."""
    pts = points(sizes=sizes, law=joint_law, noise_seed=1)
    log_x = np.log([[p.params, p.tokens] for p in pts])
    log_loss = np.log([p.loss for p in pts])
    ((theta, objective, _),) = fits_and_refits([(log_x, log_loss, np.ones((1, len(pts))))])
    assert not law_profiles(log_x, log_loss, theta, objective)["alpha"].identified


@settings(max_examples=4, deadline=None)
@given(st.permutations(range(len(SIZES) * 16)))
def test_profile_does_not_depend_on_the_order_of_the_points(known_law_fit, known_law_profiles, order):
    log_x, log_loss, theta, objective = known_law_fit
    again = law_profiles(log_x[list(order)], log_loss[list(order)], theta, objective)
    for name, profile in known_law_profiles.items():
        np.testing.assert_allclose(again[name].values, profile.values, rtol=1e-6)
        np.testing.assert_allclose(again[name].objectives, profile.objectives, rtol=1e-5)
        assert again[name].identified == profile.identified
