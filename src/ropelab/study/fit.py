"""Scaling laws and their fit, for studies that train at several token budgets.

The fits follow Hoffmann et al. 2022 (Chinchilla), approach 3: minimise the Huber loss (delta 1e-3)
of the log residuals of

    L(D)    = E + exp(b - beta * log D)                               (`fit_data_law`)
    L(N, D) = E + exp(a - alpha * log N) + exp(b - beta * log D)      (`fit_joint_law`)

by scipy's L-BFGS-B (`scipy.optimize.minimize`, one call per fit, with E and the exponents bounded
at 0) from the 12 best points of Chinchilla's grid, keeping the best optimum. Besiroglu et al. 2024
(Chinchilla scaling: a replication attempt) refitted approach 3 and found the published intervals
implausibly narrow and the fit itself off, most likely from the optimiser stopping early. So a study's
fits come with 95 % percentile bootstrap intervals over the seeds and the points of each seed
(`ropelab.study.bootstrap`, `ropelab.study.variant_fits`), each resample refitted from the fit to all
points (`fits_and_refits`), and the optimiser runs until the objective stops falling:

- The objective is the summed Huber loss divided by delta^2 and the number of points: O(1), so that
  scipy's relative tolerance (`FTOL`) means what it says. The plain sum is ~1e-5, below the
  max(|f|, 1) that scipy's ftol is relative to, so that its default stops at the start.
- E is a variable of its own, bounded at 0 (as are the exponents), where Chinchilla's logsumexp has
  e = log E. Fits to few budgets or a short span of D (common among resamples) often have their
  optimum at E -> 0, at the end of a long curved valley: with e = log E it lies at e = -inf, which
  L-BFGS approaches for thousands of steps (up to its cap) and leaves anywhere on the way; with
  E >= 0 it lands on E = 0 and stops.

A study's measurements are `Point`s (a variant, a seed, N = non-embedding parameters, D = training
tokens, the loss at the end of that run). Budgets are named in tokens per parameter, as in
Chinchilla's 20 tokens per parameter: ``{"20 tokens/param": 20.0}`` predicts at D = 20 * N.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from ropelab.config import ConfigError

__all__ = ["MIN_BUDGETS", "MIN_SIZES", "DataLaw", "JointLaw", "Point", "check_points", "checked_curve",
           "fit_data_law", "fit_joint_law", "fits_and_refits", "predict_data_laws", "predict_joint_laws",
           "refit_fixed", "require_budgets"]

HUBER_DELTA = 1e-3
# Chinchilla's grid of starting points: log E, the log coefficients, the exponents
LOG_E_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
LOG_COEFFICIENT_GRID = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
EXPONENT_GRID = (0.0, 0.5, 1.0, 1.5, 2.0)
STARTS = 12  # L-BFGS-B runs from the 12 grid points of lowest objective, not from all 5400 of the joint law
# scipy's L-BFGS-B stops when a step gains less than FTOL (relative to max(|f|, 1)), when no component
# of the projected gradient exceeds GTOL, or after MAX_ITER steps
FTOL, GTOL, MAX_ITER = 1e-10, 1e-8, 2000
MIN_BUDGETS = 3
MIN_SIZES = 3  # with two sizes, E, A and alpha of the joint law are not identified (two levels, three unknowns)


@dataclass(frozen=True)
class Point:
    """One run's final loss: `params` = non-embedding parameters N, `tokens` = training tokens D."""
    variant: str
    seed: int | str | None
    params: float
    tokens: float
    loss: float


@dataclass(frozen=True)
class DataLaw:
    """L(D) = E + B * D^-beta; `objective` is the summed Huber loss of the fit over its `n_points`."""
    E: float
    B: float
    beta: float
    objective: float
    n_points: int

    @classmethod
    def from_theta(cls, theta: np.ndarray, objective: float, n_points: int) -> DataLaw:
        """The law of a fit's theta = [E, log B, beta]."""
        return cls(float(theta[0]), float(np.exp(theta[1])), float(theta[2]), float(objective), n_points)

    def predict(self, tokens):
        return self.E + self.B * np.asarray(tokens, dtype=float) ** -self.beta


@dataclass(frozen=True)
class JointLaw:
    """L(N, D) = E + A * N^-alpha + B * D^-beta, N = non-embedding parameters, D = tokens."""
    E: float
    A: float
    alpha: float
    B: float
    beta: float
    objective: float
    n_points: int

    @classmethod
    def from_theta(cls, theta: np.ndarray, objective: float, n_points: int) -> JointLaw:
        """The law of a fit's theta = [E, log A, alpha, log B, beta]."""
        e, a, alpha, b, beta = (float(v) for v in theta)
        return cls(e, float(np.exp(a)), alpha, float(np.exp(b)), beta, float(objective), n_points)

    def predict(self, params, tokens):
        return (self.E + self.A * np.asarray(params, dtype=float) ** -self.alpha
                + self.B * np.asarray(tokens, dtype=float) ** -self.beta)


def _positive_finite(values, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=float).ravel()
    bad = np.flatnonzero(~(np.isfinite(array) & (array > 0)))
    if bad.size:
        raise ConfigError(f"fit: {what} must be finite and positive, got {float(array[bad[0]])!r} at index {bad[0]}")
    return array


def checked_curve(tokens, losses) -> tuple[np.ndarray, np.ndarray]:
    """One curve's token counts and losses as arrays of equal size; a one-line ConfigError when a value
    is not finite and positive or the sizes differ."""
    tokens, losses = _positive_finite(tokens, "tokens"), _positive_finite(losses, "loss")
    if tokens.shape != losses.shape:
        raise ConfigError(f"fit: {tokens.size} token counts for {losses.size} losses")
    return tokens, losses


def require_budgets(tokens, what: str) -> None:
    """A one-line ConfigError unless `tokens` holds `MIN_BUDGETS` distinct budgets (`what` needs them)."""
    if np.unique(tokens).size < MIN_BUDGETS:
        raise ConfigError(f"fit: {what} needs at least {MIN_BUDGETS} distinct token budgets, "
                          f"got {np.unique(tokens).size}")


def check_points(points: Sequence[Point]) -> list[Point]:
    """The points as a list; ConfigError when there are none or a value is not finite and positive."""
    points = list(points)
    if not points:
        raise ConfigError("fit: no points to fit")
    for what in ("params", "tokens", "loss"):
        _positive_finite([getattr(p, what) for p in points], what)
    return points


def _objective(theta: np.ndarray, log_x: np.ndarray, log_loss: np.ndarray,
               weights: np.ndarray) -> tuple[float, np.ndarray]:
    """For theta = [E, c_1, p_1, ..., c_k, p_k] (L = E + sum_j exp(c_j - p_j log x_j)) on the points
    log_x (points x k), log_loss: the sum of the Huber losses of the log residuals weighted by `weights`,
    and its gradient."""
    power = np.exp(np.minimum(theta[1::2] - theta[2::2] * log_x, 700.0))
    pred = np.maximum(theta[0] + power.sum(axis=1), 1e-300)
    residual = np.log(pred) - log_loss
    clipped = np.minimum(np.maximum(residual, -HUBER_DELTA), HUBER_DELTA)
    slope = weights * clipped  # huber(delta, r) = clipped * (r - clipped / 2)
    by_pred, gradient = slope / pred, np.empty(theta.size)  # by_pred: d objective / d pred
    gradient[0], gradient[1::2], gradient[2::2] = by_pred.sum(), by_pred @ power, -(by_pred @ (power * log_x))
    return float(slope @ (residual - clipped / 2)), gradient


def _minimise(start: np.ndarray, log_x: np.ndarray, log_loss: np.ndarray,
              counts: np.ndarray, fixed: tuple[int, float] | None = None) -> tuple[np.ndarray, float]:
    """scipy's L-BFGS-B from `start` on the points weighted by `counts`, with E and the exponents >= 0
    (`fixed`: (index, value) of E or an exponent held at that value). It minimises the summed Huber loss divided by delta^2 and the number of points (see the module), in
    log x centred on its mean (c_j - p_j * mean, which takes most of the correlation of c_j and p_j out);
    returns the optimum and its summed Huber loss."""
    used = counts > 0
    log_x, log_loss, counts = log_x[used], log_loss[used], counts[used]
    centre, scale, shift = log_x.mean(axis=0), HUBER_DELTA ** 2 * counts.sum(), np.zeros(start.size)
    shift[1::2] = centre
    bounds = [(0.0, None) if j % 2 == 0 else (None, None) for j in range(start.size)]
    if fixed is not None:
        start, (index, value) = start.copy(), fixed
        start[index], bounds[index] = value, (value, value)
    result = minimize(_objective, start - shift * np.roll(start, -1), (log_x - centre, log_loss, counts / scale),
                      method="L-BFGS-B", jac=True, bounds=bounds,
                      options={"ftol": FTOL, "gtol": GTOL, "maxiter": MAX_ITER})
    return result.x + shift * np.roll(result.x, -1), result.fun * scale


def _fit(log_x: np.ndarray, log_loss: np.ndarray, start: np.ndarray | None = None,
         counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fits of one law (log x: points x k) by `_minimise`, a fit per row of `counts` (the multiplicities
    of the points; None: one fit, each point once). From `start`, every fit starts there; without, the
    one fit is the best of those from the STARTS grid points of lowest objective. Returns theta (fits x
    parameters) and each fit's summed Huber loss."""
    counts = np.ones((1, len(log_loss))) if counts is None else counts
    if start is None:
        grid = np.array(list(itertools.product(LOG_E_GRID, *[LOG_COEFFICIENT_GRID, EXPONENT_GRID] * log_x.shape[1])))
        grid[:, 0] = np.exp(grid[:, 0])
        objective = [_objective(theta, log_x, log_loss, counts[0])[0] for theta in grid]
        starts = grid[np.argsort(objective, kind="stable")[:STARTS]]
        fits = [_minimise(theta, log_x, log_loss, counts[0]) for theta in starts]
        theta, objective = min(fits, key=lambda fit: fit[1])
        return theta[None], np.array([objective])
    fits = [_minimise(start, log_x, log_loss, row) for row in counts]
    return np.array([theta for theta, _ in fits]), np.array([objective for _, objective in fits])


def _theta(law: DataLaw | JointLaw) -> np.ndarray:
    if isinstance(law, DataLaw):
        return np.array([law.E, np.log(law.B), law.beta])
    return np.array([law.E, np.log(law.A), law.alpha, np.log(law.B), law.beta])


def predict_data_laws(theta: np.ndarray, tokens: float) -> np.ndarray:
    """The data law of each row of theta (fits x [E, log B, beta]) at `tokens`."""
    return theta[:, 0] + np.exp(theta[:, 1] - theta[:, 2] * np.log(tokens))


def predict_joint_laws(theta: np.ndarray, params: float, tokens: float) -> np.ndarray:
    """The joint law of each row of theta (fits x [E, log A, alpha, log B, beta]) at N = `params`, D = `tokens`."""
    log_n, log_d = np.log(params), np.log(tokens)
    return theta[:, 0] + np.exp(theta[:, 1] - theta[:, 2] * log_n) + np.exp(theta[:, 3] - theta[:, 4] * log_d)


def fits_and_refits(curves: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """For each (log x, log loss, multiplicities of the points in each resample): the fit to all points
    from the grid (theta and its summed Huber loss), and the resamples' refits from it (thetas)."""
    full = [(x, y, counts, *_fit(x, y)) for x, y, counts in curves]
    return [(theta[0], objective[0], _fit(x, y, theta[0], counts)[0]) for x, y, counts, theta, objective in full]


def refit_fixed(log_x: np.ndarray, log_loss: np.ndarray, start: np.ndarray, index: int,
                value: float) -> tuple[np.ndarray, float]:
    """The law's fit (theta and summed Huber loss) to the points (log x: points x k, each once) from
    `start`, with parameter `index` of theta held at `value`: E (0) or an exponent (2, 4), which are not
    shifted by `_minimise`'s centring, so that holding them is a bound of L-BFGS-B."""
    if index % 2:
        raise ConfigError(f"fit: parameter {index} of theta is a log coefficient; only E and the exponents can be held")
    return _minimise(start, log_x, log_loss, np.ones(len(log_loss)), (index, value))


def fit_data_law(tokens, losses, start: DataLaw | None = None) -> DataLaw:
    """L(D) = E + B * D^-beta fitted to the points (several seeds per budget welcome), by Hoffmann et al.
    2022 approach 3 (see the module). `start`: a fit to start from instead of the grid. ConfigError:
    fewer than 3 budgets, or a value that is not finite and positive."""
    tokens, losses = checked_curve(tokens, losses)
    require_budgets(tokens, "L(D) = E + B*D^-beta")
    start = None if start is None else _theta(start)
    (theta,), (objective,) = _fit(np.log(tokens)[:, None], np.log(losses), start)
    return DataLaw.from_theta(theta, objective, tokens.size)


def fit_joint_law(params, tokens, losses, start: JointLaw | None = None) -> JointLaw:
    """L(N, D) = E + A * N^-alpha + B * D^-beta, by the same method as `fit_data_law`. Needs 3 sizes
    (with two, E, A and alpha are not identified) and 3 budgets."""
    params = _positive_finite(params, "params")
    tokens, losses = checked_curve(tokens, losses)
    if params.shape != tokens.shape:
        raise ConfigError(f"fit: {params.size} parameter counts for {tokens.size} losses")
    if np.unique(params).size < MIN_SIZES:
        raise ConfigError(f"fit: L(N, D) needs at least {MIN_SIZES} model sizes, got {np.unique(params).size}")
    require_budgets(tokens, "L(N, D)")
    log_x, start = np.log(np.column_stack([params, tokens])), None if start is None else _theta(start)
    (theta,), (objective,) = _fit(log_x, np.log(losses), start)
    return JointLaw.from_theta(theta, objective, tokens.size)

