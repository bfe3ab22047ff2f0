"""Study analysis on synthetic loss curves: spikes, bands, noise, steps-to-target, smoothing."""

import math

import numpy as np
import pytest

from ropelab.study.analysis import (
    convergence_bands,
    detect_spikes,
    estimate_noise,
    final_loss,
    smooth,
    steps_to_target,
    tail_noise,
)

STEPS = np.arange(1, 2001)


def decaying(seed: int = 0, noise: float = 0.03, floor: float = 3.0) -> np.ndarray:
    """A training-like curve: fast early drop, slow tail, Gaussian batch noise."""
    rng = np.random.default_rng(seed)
    clean = floor + 7.0 * np.exp(-STEPS / 80) + 0.5 * np.exp(-STEPS / 800)
    return clean + rng.normal(0.0, noise, STEPS.size)


# ------------------------------------------------------------------------------ smooth


def test_smooth_centered_keeps_a_linear_trend_and_the_length():
    x = np.linspace(5.0, 1.0, 101)
    out = smooth(x, 11)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, x, atol=1e-12)


def test_smooth_ema_starts_at_first_value_and_lags_a_decreasing_curve():
    x = np.linspace(5.0, 1.0, 101)
    out = smooth(x, 11, kind="ema")
    assert out[0] == pytest.approx(5.0)
    assert np.all(out[1:] > x[1:])


def test_smooth_skips_nan_and_reduces_noise():
    rng = np.random.default_rng(1)
    x = 2.0 + rng.normal(0, 0.1, 1000)
    x[500] = np.nan
    out = smooth(x, 21)
    assert np.isfinite(out).all()
    assert np.std(out[50:-50]) < 0.4 * np.std(x[np.isfinite(x)])
    with pytest.raises(ValueError):
        smooth(x, 5, kind="median")


# ------------------------------------------------------------------------------ spikes


@pytest.mark.parametrize("seed", range(10))
def test_clean_noisy_decaying_curve_has_no_spikes(seed):
    assert detect_spikes(STEPS, decaying(seed)) == []


def test_heavy_tailed_noise_alone_gives_no_spikes():
    rng = np.random.default_rng(7)
    clean = 3.0 + 7.0 * np.exp(-STEPS / 80)
    for _ in range(5):
        assert detect_spikes(STEPS, clean + 0.05 * rng.standard_t(3, STEPS.size)) == []


def test_injected_recovered_spike_is_found_and_marked_recovered():
    x = decaying(3)
    x[1000:1005] += [1.0, 1.5, 1.2, 0.6, 0.3]
    x[1005:1040] += 0.3 * np.exp(-np.arange(35) / 8)
    spikes = detect_spikes(STEPS, x)
    assert len(spikes) == 1
    spike = spikes[0]
    assert spike.step == 1002 and spike["step"] == 1002  # the peak; readable both ways
    assert spike.start_step == 1001
    assert spike.loss == pytest.approx(x[1001])
    clean_before = 3.0 + 7.0 * math.exp(-975 / 80) + 0.5 * math.exp(-975 / 800)
    assert spike.baseline == pytest.approx(clean_before, abs=0.02)
    assert spike.recovered is True
    assert 1005 < spike.recovery_step < 1100


def test_injected_spike_with_permanent_level_jump_is_unrecovered_and_reported_once():
    x = decaying(4)
    x[1200] += 1.0
    x[1201:] += 0.4
    spikes = detect_spikes(STEPS, x)
    assert len(spikes) == 1
    assert spikes[0].start_step == 1201
    assert spikes[0].recovered is False and spikes[0].recovery_step is None


def test_two_separate_spikes_and_divergence():
    x = decaying(5)
    x[600:610] += 0.8
    x[1500:] = np.nan  # the run diverges
    spikes = detect_spikes(STEPS, x)
    assert [s.recovered for s in spikes] == [True, False]
    assert spikes[0].start_step == 601
    assert spikes[1].start_step == 1501 and math.isnan(spikes[1].loss)


def test_single_bad_batch_is_an_outlier_unless_min_points_is_one():
    x = decaying(6)
    x[900] += 1.0
    assert detect_spikes(STEPS, x) == []
    found = detect_spikes(STEPS, x, min_points=1)
    assert len(found) == 1 and found[0].step == 901 and found[0].recovered


def test_detect_spikes_edge_cases():
    assert detect_spikes([], []) == []
    assert detect_spikes(STEPS[:5], decaying()[:5]) == []  # too short for a baseline
    with pytest.raises(ValueError):
        detect_spikes(STEPS[:3], [1.0, 2.0])


# ------------------------------------------------------------------------------- bands


def test_two_clusters_far_beyond_noise_give_two_bands():
    finals = {"nope": 3.305, "2ch": 3.30, "r10": 3.102, "r25": 3.100, "r50": 3.101, "full": 3.099}
    bands = convergence_bands(finals, noise=0.003)
    assert {k: bands[k] for k in ("r10", "r25", "r50", "full")} == dict.fromkeys(("r10", "r25", "r50", "full"), 0)
    assert bands["nope"] == bands["2ch"] == 1


def test_all_within_noise_give_one_band():
    rng = np.random.default_rng(0)
    finals = {f"run{i}": 3.1 + rng.normal(0, 0.002) for i in range(7)}
    assert set(convergence_bands(finals, noise=0.005).values()) == {0}


def test_bands_are_ordered_from_lowest_loss_and_skip_non_finite():
    bands = convergence_bands({"a": 2.0, "b": 3.0, "c": 1.0, "d": float("nan"), "e": None}, noise=0.01)
    assert bands == {"c": 0, "a": 1, "b": 2, "d": None, "e": None}
    with pytest.raises(ValueError):
        convergence_bands({"a": 1.0}, noise=float("nan"))


def test_estimate_noise_prefers_seed_replicas():
    curves = {}
    for seed, shift in enumerate([0.0, 0.02, -0.02]):
        curves[f"full_s{seed}"] = (STEPS, decaying(seed, noise=0.01) + shift)
    curves["nope"] = (STEPS, decaying(9, noise=0.01) + 0.3)
    noise, source = estimate_noise(curves, [["full_s0", "full_s1", "full_s2"], ["nope"]], return_source=True)
    assert source == "seeds"
    assert noise == pytest.approx(0.02, rel=0.1)


def test_estimate_noise_from_curve_tails_without_replicas():
    curves = {f"r{i}": (STEPS, decaying(i, noise=0.04)) for i in range(3)}
    noise, source = estimate_noise(curves, None, return_source=True)
    assert source == "curves"
    n_tail = int(np.sum(STEPS >= STEPS[-1] - 0.1 * (STEPS[-1] - STEPS[0])))
    assert noise == pytest.approx(0.04 / math.sqrt(n_tail), rel=0.25)
    assert tail_noise(STEPS, decaying(0, noise=0.04)) == pytest.approx(0.04 / math.sqrt(n_tail), rel=0.25)


def test_final_loss_is_the_tail_mean_and_nan_when_diverged():
    x = np.linspace(4.0, 3.0, 101)
    assert final_loss(np.arange(101), x) == pytest.approx(np.mean(x[90:]))
    x[-1] = np.nan
    assert math.isnan(final_loss(np.arange(101), x))


# ------------------------------------------------------------------------------ target


def test_steps_to_target_on_a_known_curve():
    steps = np.arange(0, 1000)
    losses = 2.0 + 3.0 * np.exp(-steps / 100.0)  # 2 + 3/e at step 100, 2 + 3e^-3 at step 300
    assert steps_to_target(steps, losses, 2.0 + 3.0 * math.exp(-3.0), window=1) == 300
    hit = steps_to_target(steps, losses, 2.0 + 3.0 / math.e)
    assert hit in (100, 101)  # the centered mean of a convex curve sits a hair above it
    assert steps_to_target(steps, losses, 1.5) is None
    assert steps_to_target(steps * 10, losses, 5.0) == 0


def test_steps_to_target_ignores_noise_dips():
    rng = np.random.default_rng(2)
    steps = np.arange(0, 2000)
    clean = 2.0 + 3.0 * np.exp(-steps / 300.0)
    noisy = clean + rng.normal(0, 0.05, steps.size)
    target = 2.0 + 3.0 * math.exp(-2.0)  # clean curve reaches it at step 600
    assert steps_to_target(steps, noisy, target, window=1) < 590  # raw noise dips below early
    assert abs(steps_to_target(steps, noisy, target) - 600) <= 25
