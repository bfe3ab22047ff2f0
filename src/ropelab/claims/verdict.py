"""Verdicts on the seeds' claims: `holds`, `does not hold` or `inconclusive`, from measurements with
seed replicas, by one rule: `RULE` below, with `FRONTIER_RULE` for loss frontiers (judged in
`frontier_verdict`), which `rule_text` renders for the report.

Each function takes a group as a sequence of per-seed values and a band as {name: group}, and
returns a `Verdict` whose reason gives the numbers that decided it. The rule is invariant under
relabelling (swapping the sides of a comparison turns `holds` into `does not hold`) and under
scaling every value by a positive constant; "match" cannot be refuted by a noisy measurement, so
read it beside the spread. Input of the wrong shape (an empty band, a name on both sides, a curve
of the wrong length) is a ConfigError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean
from typing import Mapping, Optional, Sequence

from ropelab.config import ConfigError

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
K = 2.0
MIN_SEEDS = 2
FLOOR = 1e-6
SLOPE_CONFIDENCE = 0.95  # the frontier gap's slope interval: a bootstrap over seeds and budgets
RESAMPLES = 2000
BOOTSTRAP_SEED = 0

RULE = f"""
A group is one configuration measured once per seed (e.g. the final validation loss of the 25%
run at seeds 0 and 1). The seed-to-seed spread of a claim is the largest range (maximum minus
minimum over seeds) of any group it compares; a difference between two groups' means counts only
when it exceeds k = {K:g} times that spread. A claim that compares groups is inconclusive when a
group has fewer than {MIN_SEEDS} seeds or a value that is not a finite number. "A is higher than B" (each
side a band of one or more groups) holds when every group of A is higher than every group of B by
a difference that counts, does not hold when some group of B is higher than some group of A by a
difference that counts, and is inconclusive otherwise. "A is lower than B" (fewer loss spikes, a
smaller perturbation) is "B is higher than A". "A beats B beyond length L" is "A is lower than
B" on each seed's mean loss over the positions L and beyond. "The metric rises sharply at
fraction c" holds when every fraction at or above c is better than every fraction below c by a
difference that counts and that is also larger than the range of the means at or above c; it
does not hold when some fraction below c is better than one at or above c by a difference that
counts, or when the rise counts but is not larger than that range (a gradual rise); otherwise it
is inconclusive. "The groups match" holds when no two groups' means differ by a difference that
counts and does not hold when two do. "A perturbation is present" holds when every replica
exceeds the floor of {FLOOR:g} and does not hold when none does ("absent" is the reverse); replicas
on both sides of the floor are inconclusive. Claims taken together hold when each holds, do not
hold when any does not hold, and are inconclusive otherwise.
"""

FRONTIER_RULE = f"""
A frontier is one configuration's final validation loss at several token budgets, one value per
seed at each budget; the frontiers compared share their budgets and seeds. The gap between two
frontiers is, per seed and budget, the first loss minus the second. At the largest budget the gap
counts when the difference of the two groups' means exceeds k times the noise, the spread of those
two groups. The trend of the gap is its least-squares slope against log2 of the budget (per
doubling of tokens) over every seed and budget, with a {SLOPE_CONFIDENCE:.0%} bootstrap interval
({RESAMPLES} resamples of the seeds and of the budgets, with replacement, from a fixed generator seed;
a resample with a single budget is left out). The gap grows when the whole interval lies on the side
that moves it away from zero and shrinks when the whole interval lies on the side that moves it
toward zero; the side is that of the gap at the largest budget when that gap counts, and otherwise
that of the mean gap over every seed and budget, so that a gap that has closed into the noise does
not grow (from a zero gap, either side is away). A frontier with fewer
than {MIN_SEEDS} seeds at a budget or a value that is not finite is inconclusive. "A matches B" on
frontiers holds when the gap at the largest budget does not count and does not grow, does not hold
when it counts and does not shrink, and is inconclusive otherwise. "A is higher than B" on
frontiers holds when A is higher at the largest budget by a gap that counts and does not shrink,
does not hold when B is higher there by a gap that counts and does not shrink, and is inconclusive
otherwise; with bands, every frontier of A is judged against every frontier of B and the verdicts
are taken together. An inconclusive verdict names the budget at which the gap, continued from the
mean gap at the largest budget at the fitted slope, would fall within k times the noise, or says
that it would not.
"""

Group = Sequence[float]
Band = Mapping[str, Group]


@dataclass(frozen=True)
class Verdict:
    outcome: str  # HOLDS, DOES_NOT_HOLD or INCONCLUSIVE
    reason: str


def rule_text() -> str:
    """The rule, as the report states it: `RULE` and `FRONTIER_RULE` on one line."""
    return " ".join((RULE + FRONTIER_RULE).split())


def _number(x: float) -> str:
    return f"{x:.4g}"


def _unusable(groups: Band) -> Optional[Verdict]:
    """Inconclusive when a group has too few seeds or a value that is not finite, else None."""
    for name, values in groups.items():
        if len(values) < MIN_SEEDS:
            return Verdict(INCONCLUSIVE, f"{name}: {len(values)} seed(s), fewer than {MIN_SEEDS}: no seed-to-seed spread")
        if not all(math.isfinite(v) for v in values):
            return Verdict(INCONCLUSIVE, f"{name}: a value is not finite ({', '.join(map(_number, values))})")
    return None


def _spread(groups: Band) -> float:
    return max(max(values) - min(values) for values in groups.values())


def _counts(difference: float, spread: float) -> str:
    return f"difference {_number(difference)} against {K:g} x spread {_number(spread)}"


def _joined(high: Band, low: Band) -> Band:
    for side, band in (("first", high), ("second", low)):
        if not band:
            raise ConfigError(f"verdict: the {side} band has no group")
    both = sorted(set(high) & set(low))
    if both:
        raise ConfigError(f"verdict: group {both[0]!r} is on both sides of the comparison")
    return {**high, **low}


def _separation(groups: Band, high: Sequence[str], low: Sequence[str], sign: float = 1.0) -> tuple[float, float, dict, str]:
    """(gap, spread, means, the pair named): the gap between the lowest mean of the `high` groups and
    the highest of the `low` ones; the pair shows the means multiplied by `sign` (as measured)."""
    spread, means = _spread(groups), {name: fmean(values) for name, values in groups.items()}
    bottom, top = min(high, key=means.__getitem__), max(low, key=means.__getitem__)
    gap = means[bottom] - means[top]
    pair = f"{bottom} ({_number(sign * means[bottom])}) against {top} ({_number(sign * means[top])}): {_counts(gap, spread)}"
    return gap, spread, means, pair


def _by_sign(gap: float, spread: float, pair: str) -> Verdict:
    if gap > K * spread:
        return Verdict(HOLDS, pair)
    if -gap > K * spread:
        return Verdict(DOES_NOT_HOLD, pair)
    return Verdict(INCONCLUSIVE, pair + ", within the noise")


def higher(high: Band, low: Band) -> Verdict:
    """"Every group of `high` is higher than every group of `low`" (RQ1-RQ5: a higher-loss band)."""
    groups = _joined(high, low)
    unusable = _unusable(groups)
    if unusable:
        return unusable
    gap, spread, _, pair = _separation(groups, list(high), list(low))
    return _by_sign(gap, spread, pair)


def lower(low: Band, high: Band) -> Verdict:
    """"Every group of `low` is lower than every group of `high`" (fewer spikes with QK-Norm, a
    smaller perturbation after the long phase, a lower loss)."""
    return higher(high, low)


def beats_beyond(a: Mapping[str, Sequence[Sequence[float]]], b: Mapping[str, Sequence[Sequence[float]]],
                 positions: Sequence[int], length: int) -> Verdict:
    """"`a` has a lower loss than `b` at positions `length` and beyond" (KD vs CE; phase-wise theta
    against constant thetas, `b` holding both). A group is one loss-by-position curve per seed, each
    over `positions`."""
    beyond = [i for i, position in enumerate(positions) if position >= length]
    if not beyond:
        raise ConfigError(f"verdict: no position at or beyond length {length}")

    def tails(band):
        out = {}
        for name, curves in band.items():
            for curve in curves:
                if len(curve) != len(positions):
                    raise ConfigError(f"verdict: group {name!r} has a curve of {len(curve)} values for {len(positions)} positions")
            out[name] = [fmean(curve[i] for i in beyond) for curve in curves]
        return out

    return lower(tails(a), tails(b))


def rises_sharply(by_fraction: Mapping[float, Group], cut: float, higher_is_better: bool = True) -> Verdict:
    """"The metric improves sharply from fractions below `cut` to those at or above it" (RQ6: LAMBADA
    accuracy, or perplexity with `higher_is_better=False`); a group is the metric per seed."""
    sign = 1.0 if higher_is_better else -1.0
    groups = {f"fraction {fraction:g}": [sign * v for v in values] for fraction, values in by_fraction.items()}
    above = [f"fraction {f:g}" for f in by_fraction if f >= cut]
    below = [f"fraction {f:g}" for f in by_fraction if f < cut]
    if not above or not below:
        raise ConfigError(f"verdict: fractions {', '.join(f'{f:g}' for f in by_fraction)} do not fall on both sides of {cut:g}")
    unusable = _unusable(groups)
    if unusable:
        return unusable
    gap, spread, means, pair = _separation(groups, above, below, sign)
    verdict = _by_sign(gap, spread, pair)
    if verdict.outcome != HOLDS:
        return verdict
    above_range = max(means[f] for f in above) - min(means[f] for f in above)
    span = f"the fractions at or above {cut:g} span {_number(above_range)}"
    return Verdict(HOLDS, f"{pair}; {span}") if gap > above_range else Verdict(DOES_NOT_HOLD, f"{pair}, a gradual rise: {span}")


def matches(groups: Band) -> Verdict:
    """"The groups match" (10% and more match full RoPE; multiple-choice accuracy flat across fractions)."""
    if len(groups) < 2:
        raise ConfigError(f"verdict: matching needs at least 2 groups, got {len(groups)}")
    unusable = _unusable(groups)
    if unusable:
        return unusable
    gap, spread, _, pair = _separation(groups, list(groups), list(groups))  # the lowest mean against the highest
    return Verdict(DOES_NOT_HOLD if -gap > K * spread else HOLDS, pair)


def _against_floor(values: Group, want_above: bool) -> Verdict:
    if not values:
        raise ConfigError("verdict: no perturbation measured")
    if not all(math.isfinite(v) for v in values):
        return Verdict(INCONCLUSIVE, f"a value is not finite ({', '.join(map(_number, values))})")
    above = sum(v > FLOOR for v in values)
    seen = f"{above} of {len(values)} above the floor {FLOOR:g} ({', '.join(map(_number, values))})"
    if above in (0, len(values)):
        return Verdict(HOLDS if (above > 0) == want_above else DOES_NOT_HOLD, seen)
    return Verdict(INCONCLUSIVE, seen)


def present(values: Group) -> Verdict:
    """"The perturbation is present" (causal attention, running positions): every replica above `FLOOR`."""
    return _against_floor(values, True)


def absent(values: Group) -> Verdict:
    """"The perturbation vanishes" (document mask, restarting positions): no replica above `FLOOR`."""
    return _against_floor(values, False)


def all_hold(verdicts: Sequence[Verdict]) -> Verdict:
    """Claims taken together: each must hold."""
    if not verdicts:
        raise ConfigError("verdict: no claim to combine")
    for outcome in (DOES_NOT_HOLD, INCONCLUSIVE):
        deciding = [v.reason for v in verdicts if v.outcome == outcome]
        if deciding:
            return Verdict(outcome, "; ".join(deciding))
    return Verdict(HOLDS, "; ".join(v.reason for v in verdicts))
