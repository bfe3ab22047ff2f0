"""Fits per variant and size with bootstrap intervals, and gaps between variants (one set of resamples
for fits and gaps), on synthetic losses drawn from known laws."""

import numpy as np
import pytest

from ropelab.config import ConfigError
from ropelab.study.fit import Point
from ropelab.study.variant_fits import fit_gaps, fit_variants, gap, joint_gap
from scaling_points import ALPHA, BETA, BUDGETS, E, PARAMS, RESAMPLES, data_law, joint_law, points


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


def test_bad_points_are_refused():
    with pytest.raises(ConfigError, match="params must be finite and positive"):
        fit_variants([Point("v", 0, float("inf"), float(d), 2.0) for d in BUDGETS])
    with pytest.raises(ConfigError, match="no points"):
        fit_variants([])
    with pytest.raises(ConfigError, match="variants 'a' and 'b' have no model size in common"):
        gap(points("a") + points("b", sizes=(1e6,)), "a", "b")


def test_joint_gap_pairs_the_resamples_of_both_variants():
    """Two variants from one joint law, one shifted by 0.05: their predicted gap far outside the sizes
    measured holds -0.05 with the same resamples; a variant against itself has a zero-width interval."""
    sizes = (1e5, 1e6, 1e7)
    both = (points("rope", sizes=sizes, law=joint_law, noise_seed=1)
            + points("nope", sizes=sizes, law=lambda n, d: joint_law(n, d) + 0.05, noise_seed=2)
            + points("short", noise_seed=3))
    fits = fit_variants(both, resamples=30)
    rope, nope, short = fits
    assert rope.joint_samples.shape == (30, 5) and short.joint is None and rope.identified("alpha")
    far = joint_gap(fits, "rope", "nope", 1e9, 1e11)
    assert far.value == pytest.approx(float(rope.joint.predict(1e9, 1e11) - nope.joint.predict(1e9, 1e11)))
    assert far.contains(-0.05)
    itself = joint_gap(fits, "rope", "rope", 1e9, 1e11)
    assert itself.low == itself.high == itself.value == 0.0
    with pytest.raises(ConfigError, match="'short' has no joint law"):
        joint_gap(fits, "rope", "short", 1e9, 1e11)
