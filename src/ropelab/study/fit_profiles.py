"""Profiles of a scaling law's parameters, and whether the data identify each.

The profile of a parameter (E, or an exponent alpha / beta) is the fit's objective with that
parameter held at each value of a grid and the others refitted (scipy's L-BFGS-B, walking out from the
best fit: the better of the refits from the neighbouring grid point's fit and from the best fit, as
either alone can stall in the law's curved valleys; E and the exponents stay >= 0). The coefficients A
and B are not profiled: they are scales the exponents and E leave to be fitted.

**Interval.** The profile interval is {theta: objective(theta) <= objective_min * (1 + F / (n - p))},
F = the 0.95 quantile of F(1, n - p), n points, p parameters of the law: the F-test (extra sum of
squares) form of a 95 % profile interval for least squares. The objective here is the Huber loss of
the log residuals (`HUBER_DELTA` = 1e-3, in nats of log loss): residuals below delta count squared,
larger ones linearly, so with residuals of several delta the objective is closer to a sum of absolute
values and the interval is approximate. It is read as "the values the data cannot tell from the best
fit", not as an exact coverage.

**Identified.** A parameter is identified when its interval is bounded inside the grid searched: it
starts above 0 (E at 0, or an exponent at 0 so that its term is a constant, is what a flat or
too-short profile reaches) and ends below the grid's upper end. The grid runs from 0 to
`EXPONENT_REACH` x the best value (at least `MIN_EXPONENT_REACH`) for an exponent, and to just below
the smallest loss measured for E (E at or past it cannot fit the points); from a best fit at 0 the
grid is denser near 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import f as f_distribution

from ropelab.study.fit import refit_fixed

__all__ = ["GRID_POINTS", "LAW_PARAMETERS", "Profile", "law_profiles", "profile"]

GRID_POINTS = 25
CONFIDENCE = 0.95
EXPONENT_REACH, MIN_EXPONENT_REACH = 3.0, 1.0
E_REACH = 1 - 1e-3  # E's grid ends this fraction of the smallest loss
# theta's index of each profiled parameter, by the number of the law's parameters (3: L(D), 5: L(N, D))
LAW_PARAMETERS = {3: {"E": 0, "beta": 2}, 5: {"E": 0, "alpha": 2, "beta": 4}}


@dataclass(frozen=True)
class Profile:
    """A parameter's profile: the objective (summed Huber loss) at each grid value, the best fit's
    `best` and `minimum`, and the interval where the profile stays under `threshold` (see the module)."""
    name: str
    best: float
    minimum: float
    values: np.ndarray
    objectives: np.ndarray
    threshold: float
    low: float
    high: float

    @property
    def identified(self) -> bool:
        """The interval is bounded inside the grid: above its start (0) and below its end."""
        return self.low > self.values[0] and self.high < self.values[-1]

    @property
    def interval_text(self) -> str:
        low = "0" if self.low <= self.values[0] else f"{self.low:.4g}"
        high = f"{self.high:.4g}" + ("+ (grid end)" if self.high >= self.values[-1] else "")
        return f"[{low}, {high}]"


def _grid(best: float, upper: float) -> np.ndarray:
    """GRID_POINTS values from 0 to `upper` with `best` among them, denser near `best`."""
    if best <= 0:
        return upper * np.linspace(0.0, 1.0, GRID_POINTS) ** 2
    below = GRID_POINTS // 2
    t = np.linspace(0.0, 1.0, GRID_POINTS - below)[1:] ** 2
    return np.concatenate([np.linspace(0.0, best, below, endpoint=False), [best], best + (upper - best) * t])


def _crossing(values: np.ndarray, objectives: np.ndarray, threshold: float, start: int, step: int) -> float:
    """Walking from grid index `start` by `step`: the value where the profile first rises past
    `threshold` (linear between grid points), or the grid's end when it never does."""
    i = start
    while 0 <= i + step < len(values):
        if objectives[i + step] > threshold:
            a, b = objectives[i], objectives[i + step]
            share = (threshold - a) / (b - a) if b > a else 0.0
            return float(values[i] + share * (values[i + step] - values[i]))
        i += step
    return float(values[i])


def profile(log_x: np.ndarray, log_loss: np.ndarray, theta: np.ndarray, objective: float, name: str) -> Profile:
    """The profile of parameter `name` ("E", "alpha", "beta") of the law fitted as `theta` (objective:
    its summed Huber loss) to the points (log x: points x k, log loss), each point once."""
    index = LAW_PARAMETERS[theta.size][name]
    best = float(theta[index])
    upper = max(float(np.exp(log_loss.min())) * E_REACH if index == 0
                else max(EXPONENT_REACH * best, MIN_EXPONENT_REACH), best)
    values = _grid(best, upper)
    centre = int(np.searchsorted(values, best))
    objectives = np.empty(values.size)
    objectives[centre] = objective
    for step in (-1, 1):  # walk out from the best fit, each refit the better from its neighbour's and the best fit
        start, i = theta, centre + step
        while 0 <= i < values.size:
            start, objectives[i] = min((refit_fixed(log_x, log_loss, begin, index, float(values[i]))
                                        for begin in (start, theta)), key=lambda fit: fit[1])
            i += step
    minimum = min(objective, float(objectives.min()))  # a refit may beat the given fit by rounding
    dof = log_loss.size - theta.size
    threshold = (minimum * (1 + f_distribution.ppf(CONFIDENCE, 1, dof) / dof)) if dof > 0 else np.inf
    low, high = (_crossing(values, objectives, threshold, centre, step) for step in (-1, 1))
    return Profile(name, best, minimum, values, objectives, float(threshold), low, high)


def law_profiles(log_x: np.ndarray, log_loss: np.ndarray, theta: np.ndarray, objective: float) -> dict[str, Profile]:
    """The profile of each of the law's profiled parameters (`LAW_PARAMETERS`)."""
    return {name: profile(log_x, log_loss, theta, objective, name) for name in LAW_PARAMETERS[theta.size]}
