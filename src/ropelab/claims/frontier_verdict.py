"""Verdicts on loss frontiers, by `FRONTIER_RULE` in `verdict` (which `rule_text` states in the report).

A frontier is one variant's final validation loss per token budget, one value per seed:
`{1e6: [2.31, 2.33], 2e6: [2.10, 2.11], 4e6: [1.98, 1.99]}`; a band is `{name: frontier}`, e.g.
`{"rope10": {...}, "rope100": {...}}`. The frontiers compared share their budgets, and their seeds
come in the same order at every budget, so that seed i's gap at a budget is a[i] - b[i].

`gap_trend` gives the figures: the gap at the largest budget against the seed noise there, and the
slope of the gap per doubling of tokens with a bootstrap interval. `frontier_matches` and
`frontier_higher` turn them into a `Verdict`. Like `verdict`, the rule is invariant under relabelling
(swapping the sides of `frontier_higher` turns `holds` into `does not hold`) and under scaling
every loss by a positive constant. Input of the wrong shape (an empty band, a name on both sides,
fewer than 2 budgets, budgets that differ, seed counts that differ) is a ConfigError; too few
seeds or a value that is not finite is inconclusive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from ropelab.claims.verdict import (
    BOOTSTRAP_SEED, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, RESAMPLES, SLOPE_CONFIDENCE, K, Verdict, _joined, _number,
    _spread, _unusable, all_hold,
)
from ropelab.config import ConfigError

Frontier = Mapping[float, Sequence[float]]
FrontierBand = Mapping[str, Frontier]


@dataclass(frozen=True)
class GapTrend:
    """The gap a - b between two frontiers and how it moves with tokens."""

    budgets: tuple[float, ...]  # ascending, in tokens
    gaps: Mapping[float, tuple[float, ...]]  # budget -> the gap per seed
    final_gap: float  # the difference of the two means at the largest budget
    mean_gap: float  # over every seed and budget
    noise: float  # the spread (largest seed range) of the two groups at the largest budget
    slope: float  # of the gap, per doubling of tokens, fitted over every seed and budget
    slope_interval: tuple[float, float]
    within_noise_at: Optional[float]  # tokens; see `gap_trend`

    @property
    def final_budget(self) -> float:
        return self.budgets[-1]

    @property
    def final_gaps(self) -> tuple[float, ...]:
        """The gap per seed at the largest budget."""
        return self.gaps[self.final_budget]

    @property
    def counts(self) -> bool:
        """The gap at the largest budget exceeds K x noise."""
        return abs(self.final_gap) > K * self.noise

    @property
    def _heading_from(self) -> float:
        """The gap whose sign tells away from zero: the final gap when it counts; else, as its sign is
        noise, the mean gap, so that a gap that has closed into the noise is not growing."""
        return self.final_gap if self.counts else self.mean_gap

    @property
    def grows(self) -> bool:
        """The whole slope interval moves the gap away from zero (either way, from a zero gap)."""
        low, high = self.slope_interval
        side = self._heading_from
        if side == 0:
            return low > 0 or high < 0
        return low > 0 if side > 0 else high < 0

    @property
    def shrinks(self) -> bool:
        """The whole slope interval moves the gap toward zero."""
        low, high = self.slope_interval
        side = self._heading_from
        if side == 0:
            return False
        return high < 0 if side > 0 else low > 0


def _budget_list(budgets: Iterable[float]) -> str:
    return ", ".join(map(_number, sorted(budgets)))


def _shared_budgets(frontier_a: Frontier, frontier_b: Frontier) -> list[float]:
    """The budgets of both frontiers, ascending; ConfigError unless they are the same, at least 2, positive and finite."""
    if set(frontier_a) != set(frontier_b):
        raise ConfigError(f"verdict: frontiers with different budgets: {_budget_list(frontier_a)} against {_budget_list(frontier_b)}")
    bad = [budget for budget in frontier_a if not (math.isfinite(budget) and budget > 0)]
    if bad:
        raise ConfigError(f"verdict: budget {bad[0]!r}: a budget is a positive number of tokens")
    if len(frontier_a) < 2:
        raise ConfigError(f"verdict: a frontier of {len(frontier_a)} budget(s); a trend with tokens needs at least 2")
    return sorted(frontier_a)


def _slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of y[r] (seeds x budgets) against x[r] (one per budget), for each row r."""
    x_centred = x - x.mean(axis=1, keepdims=True)
    y_centred = y - y.mean(axis=(1, 2), keepdims=True)
    return (x_centred[:, None, :] * y_centred).sum(axis=(1, 2)) / (y.shape[1] * (x_centred ** 2).sum(axis=1))


def _slope_interval(doublings: np.ndarray, gaps: np.ndarray) -> tuple[float, float]:
    """The SLOPE_CONFIDENCE bootstrap interval of the slope of `gaps` (seeds x budgets) against `doublings`."""
    seeds, budgets = gaps.shape
    generator = np.random.default_rng(BOOTSTRAP_SEED)
    seed_draws = generator.integers(seeds, size=(RESAMPLES, seeds))
    budget_draws = generator.integers(budgets, size=(RESAMPLES, budgets))
    spans = budget_draws.min(axis=1) < budget_draws.max(axis=1)  # a single budget has no slope
    seed_draws, budget_draws = seed_draws[spans], budget_draws[spans]
    slopes = np.sort(_slopes(doublings[budget_draws], gaps[seed_draws[:, :, None], budget_draws[:, None, :]]))
    # order statistics at mirrored ranks, so that negating every gap negates the interval exactly
    tail = int((1 - SLOPE_CONFIDENCE) / 2 * (len(slopes) - 1))
    return float(slopes[tail]), float(slopes[-1 - tail])


def gap_trend(frontier_a: Frontier, frontier_b: Frontier) -> GapTrend:
    """The gap `frontier_a - frontier_b` per seed and budget and its trend with tokens.

    The slope is the least-squares fit of every seed's gap at every budget against log2(budget), so
    it is per doubling of tokens. Its interval is a SLOPE_CONFIDENCE percentile bootstrap: RESAMPLES
    resamples that draw the seeds and, independently, the budgets with replacement, from a numpy
    Generator seeded with BOOTSTRAP_SEED (a resample with a single budget is left out); with 2 seeds
    and 2 budgets it spans the two seeds' slopes. `within_noise_at` is the budget, in tokens, at which
    the gap continued from `final_gap` at the fitted slope falls within K x noise: the largest budget
    when it is already within, None when the slope does not move it toward zero, inf beyond any float.

    ConfigError when the budgets differ, are fewer than 2 or not positive, or the groups differ in their
    number of seeds. The values are taken as usable (finite, 2 or more seeds); the verdicts check that.
    """
    budgets = _shared_budgets(frontier_a, frontier_b)
    seed_counts = sorted({len(values) for frontier in (frontier_a, frontier_b) for values in frontier.values()})
    if len(seed_counts) > 1:
        raise ConfigError(f"verdict: groups of {' and '.join(map(str, seed_counts))} seeds: each budget of both "
                          "frontiers needs the same seeds, in the same order")
    gaps = {budget: tuple(a - b for a, b in zip(frontier_a[budget], frontier_b[budget])) for budget in budgets}
    gap_matrix = np.array([gaps[budget] for budget in budgets], dtype=float).T  # seeds x budgets
    doublings = np.log2(np.array(budgets, dtype=float))
    slope = float(_slopes(doublings[None, :], gap_matrix[None, :, :])[0])

    final = budgets[-1]
    final_gap = fmean(frontier_a[final]) - fmean(frontier_b[final])
    noise = _spread({"a": frontier_a[final], "b": frontier_b[final]})
    excess = abs(final_gap) - K * noise
    if excess <= 0:
        within_noise_at: Optional[float] = final
    elif slope * final_gap < 0:
        doublings_left = excess / abs(slope)
        within_noise_at = final * 2.0 ** doublings_left if doublings_left < 1024 else math.inf  # 2.0 ** 1024 overflows
    else:
        within_noise_at = None
    return GapTrend(tuple(budgets), gaps, final_gap, float(gap_matrix.mean()), noise, slope,
                    _slope_interval(doublings, gap_matrix), within_noise_at)


def _figures(trend: GapTrend) -> str:
    low, high = trend.slope_interval
    return (f"gap {_number(trend.final_gap)} at {_number(trend.final_budget)} tokens "
            f"(per seed {', '.join(map(_number, trend.final_gaps))}) against {K:g} x noise {_number(trend.noise)}, "
            f"slope {_number(trend.slope)} [{_number(low)}, {_number(high)}] per doubling")


def _projection(trend: GapTrend) -> str:
    if not trend.counts:
        return "within the noise at the largest budget" + (", but growing" if trend.grows else "")
    if trend.within_noise_at is None:
        return "at the fitted slope the gap would not fall within the noise"
    return f"at the fitted slope the gap would fall within the noise at {_number(trend.within_noise_at)} tokens"


def _match(trend: GapTrend, figures: str) -> Verdict:
    if not trend.counts and not trend.grows:
        return Verdict(HOLDS, figures)
    if trend.counts and not trend.shrinks:
        return Verdict(DOES_NOT_HOLD, figures)
    return Verdict(INCONCLUSIVE, f"{figures}; {_projection(trend)}")


def _higher(trend: GapTrend, figures: str) -> Verdict:
    if trend.counts and not trend.shrinks:
        return Verdict(HOLDS if trend.final_gap > 0 else DOES_NOT_HOLD, figures)
    return Verdict(INCONCLUSIVE, f"{figures}; {_projection(trend)}")


def _judged(name_a: str, frontier_a: Frontier, name_b: str, frontier_b: Frontier,
            decide: Callable[[GapTrend, str], Verdict]) -> Verdict:
    """`decide` on the gap trend of one pair; inconclusive on unusable values, ConfigError naming the pair."""
    try:
        _shared_budgets(frontier_a, frontier_b)  # a wrong shape is an error before unusable values are inconclusive
        unusable = _unusable({f"{name} at {_number(budget)} tokens": values
                              for name, frontier in ((name_a, frontier_a), (name_b, frontier_b))
                              for budget, values in frontier.items()})
        if unusable:
            return unusable
        trend = gap_trend(frontier_a, frontier_b)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({name_a} against {name_b})") from None
    return decide(trend, f"{name_a} against {name_b}: {_figures(trend)}")


def _every_pair(band_a: FrontierBand, band_b: FrontierBand, decide: Callable[[GapTrend, str], Verdict]) -> Verdict:
    _joined(band_a, band_b)  # ConfigError for an empty band or a name on both sides
    return all_hold([_judged(name_a, frontier_a, name_b, frontier_b, decide)
                     for name_a, frontier_a in band_a.items() for name_b, frontier_b in band_b.items()])


def frontier_matches(a: FrontierBand, b: FrontierBand) -> Verdict:
    """"Every frontier of `a` matches every frontier of `b`": at the largest budget the gap does not
    count and the gap does not grow with tokens (10% RoPE matches full RoPE at the largest budget)."""
    return _every_pair(a, b, _match)


def frontier_higher(high: FrontierBand, low: FrontierBand) -> Verdict:
    """"Every frontier of `high` is higher than every frontier of `low`": at the largest budget by a gap
    that counts and does not shrink with tokens (NoPE's loss stays above the RoPE band)."""
    return _every_pair(high, low, _higher)
