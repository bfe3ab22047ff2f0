"""Bootstrap intervals: whole seeds resampled, variants with the same seeds resampled in pairs."""

import numpy as np
import pytest

from ropelab.study.bootstrap import bootstrap
from ropelab.study.fit import Point
from scaling_points import BUDGETS, PARAMS


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
