"""Scaling-law fits with bootstrap uncertainty, for studies that train at several token budgets.

The fits follow Hoffmann et al. 2022 (Chinchilla), approach 3: minimise the Huber loss (delta 1e-3)
of the log residuals of

    L(D)    = E + exp(b - beta * log D)                               (`fit_data_law`)
    L(N, D) = E + exp(a - alpha * log N) + exp(b - beta * log D)      (`fit_joint_law`)

by scipy's L-BFGS-B (`scipy.optimize.minimize`, one call per fit, with E and the exponents bounded
at 0) from the 12 best points of Chinchilla's grid, keeping the best optimum. Besiroglu et al. 2024
(Chinchilla scaling: a replication attempt) refitted approach 3 and found the published intervals
implausibly narrow and the fit itself off, most likely from the optimiser stopping early. So every
fit comes with 95 % percentile bootstrap intervals over the seeds and the points of each seed (each
resample refitted from the fit to all points), and the optimiser runs until the objective stops
falling:

- The objective is the summed Huber loss divided by delta^2 and the number of points: O(1), so that
  scipy's relative tolerance (`FTOL`) means what it says. The plain sum is ~1e-5, below the
  max(|f|, 1) that scipy's ftol is relative to, so that its default stops at the start.
- E is a variable of its own, bounded at 0 (as are the exponents), where Chinchilla's logsumexp has
  e = log E. Fits to few budgets or a short span of D (common among resamples) often have their
  optimum at E -> 0, at the end of a long curved valley: with e = log E it lies at e = -inf, which
  L-BFGS approaches for thousands of steps (up to its cap) and leaves anywhere on the way; with
  E >= 0 it lands on E = 0 and stops.
- One set of resamples serves every statistic of `fit_variants`: each size's data law and named
  budgets, the variant's joint law, and the gaps between variants (`fit_gaps`), instead of a set,
  and its refits, per statistic. A report of 5 variants x 3 sizes x 4 budgets x 2 seeds (400
  resamples) takes about a CPU minute, nearly all of it in scipy's ~14,000 L-BFGS-B runs.

A study's measurements are `Point`s (a variant, a seed, N = non-embedding parameters, D = training
tokens, the loss at the end of that run). Budgets are named in tokens per parameter, as in
Chinchilla's 20 tokens per parameter: ``{"20 tokens/param": 20.0}`` predicts at D = 20 * N.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from ropelab.config import ConfigError

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_RESAMPLES", "DataLaw", "Estimate", "Gap", "HeldOutCheck", "JointLaw",
           "Point", "SizeFit", "TailSlope", "VariantFit", "bootstrap", "check_points", "fit_data_law", "fit_gaps",
           "fit_joint_law", "fit_variants", "gap", "held_out_check", "held_out_checks", "tail_slope"]

HUBER_DELTA = 1e-3
HALF_TOLERANCE = 1.01
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
DEFAULT_RESAMPLES = 400
DEFAULT_BUDGETS: Mapping[str, float] = {"20 tokens/param": 20.0}
TAIL_FRACTION = 0.25


@dataclass(frozen=True)
class Point:
    """One run's final loss: `params` = non-embedding parameters N, `tokens` = training tokens D."""
    variant: str
    seed: int | str | None
    params: float
    tokens: float
    loss: float


@dataclass(frozen=True)
class Estimate:
    """A fitted value and its 95 % bootstrap percentile interval."""
    value: float
    low: float
    high: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def __str__(self) -> str:
        return f"{self.value:.4g} [{self.low:.4g}, {self.high:.4g}]"


@dataclass(frozen=True)
class DataLaw:
    """L(D) = E + B * D^-beta; `objective` is the summed Huber loss of the fit over its `n_points`."""
    E: float
    B: float
    beta: float
    objective: float
    n_points: int

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

    def predict(self, params, tokens):
        return (self.E + self.A * np.asarray(params, dtype=float) ** -self.alpha
                + self.B * np.asarray(tokens, dtype=float) ** -self.beta)


@dataclass(frozen=True)
class SizeFit:
    """The data law of one model size, fitted to `n_budgets` budgets; `estimates` holds "E", "beta" and
    "loss at <budget name>", `samples` their bootstrap values, resample by resample."""
    params: float
    n_budgets: int
    law: DataLaw
    estimates: dict[str, Estimate]
    samples: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class VariantFit:
    """A variant's data law per size, and its joint law (with "E", "alpha", "beta" intervals) when it has
    at least 3 sizes."""
    variant: str
    sizes: tuple[SizeFit, ...]
    joint: JointLaw | None
    joint_estimates: dict[str, Estimate]


@dataclass(frozen=True)
class Gap:
    """Variant `a`'s predicted loss minus variant `b`'s at a size and budget (negative: `a` is better)."""
    a: str
    b: str
    params: float
    budget: str
    tokens: float
    estimate: Estimate


@dataclass(frozen=True)
class HeldOutCheck:
    """A data law fitted on the budgets up to half the largest, against the measured largest budget."""
    variant: str
    params: float
    tokens: float
    fitted_up_to: float
    predicted: Estimate
    measured: float
    n_measured: int

    @property
    def inside(self) -> bool:
        return self.predicted.contains(self.measured)

    def __str__(self) -> str:
        verdict = "inside" if self.inside else "OUTSIDE"
        return (f"held-out check {self.variant} N={self.params:.3g}: fit on D <= {self.fitted_up_to:.3g}, "
                f"predicted L({self.tokens:.3g}) = {self.predicted}, measured {self.measured:.4g} "
                f"(mean of {self.n_measured}): {verdict} the interval")


@dataclass(frozen=True)
class TailSlope:
    """Loss per doubling of tokens over the last quarter of a run; see `tail_slope`."""
    slope: float
    stderr: float
    noise: float
    n_points: int
    still_falling: bool



def _positive_finite(values, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=float).ravel()
    bad = np.flatnonzero(~(np.isfinite(array) & (array > 0)))
    if bad.size:
        raise ConfigError(f"fit: {what} must be finite and positive, got {float(array[bad[0]])!r} at index {bad[0]}")
    return array


def _curve(tokens, losses) -> tuple[np.ndarray, np.ndarray]:
    tokens, losses = _positive_finite(tokens, "tokens"), _positive_finite(losses, "loss")
    if tokens.shape != losses.shape:
        raise ConfigError(f"fit: {tokens.size} token counts for {losses.size} losses")
    return tokens, losses


def _require_budgets(tokens, what: str) -> None:
    if np.unique(tokens).size < MIN_BUDGETS:
        raise ConfigError(f"fit: {what} needs at least {MIN_BUDGETS} distinct token budgets, "
                          f"got {np.unique(tokens).size}")


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
              counts: np.ndarray) -> tuple[np.ndarray, float]:
    """scipy's L-BFGS-B from `start` on the points weighted by `counts`, with E and the exponents >= 0.
    It minimises the summed Huber loss divided by delta^2 and the number of points (see the module), in
    log x centred on its mean (c_j - p_j * mean, which takes most of the correlation of c_j and p_j out);
    returns the optimum and its summed Huber loss."""
    used = counts > 0
    log_x, log_loss, counts = log_x[used], log_loss[used], counts[used]
    centre, scale, shift = log_x.mean(axis=0), HUBER_DELTA ** 2 * counts.sum(), np.zeros(start.size)
    shift[1::2] = centre
    bounds = [(0.0, None) if j % 2 == 0 else (None, None) for j in range(start.size)]
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


def _data_law(theta: np.ndarray, objective: float, n_points: int) -> DataLaw:
    return DataLaw(float(theta[0]), float(np.exp(theta[1])), float(theta[2]), float(objective), n_points)


def _joint_law(theta: np.ndarray, objective: float, n_points: int) -> JointLaw:
    e, a, alpha, b, beta = (float(v) for v in theta)
    return JointLaw(e, float(np.exp(a)), alpha, float(np.exp(b)), beta, float(objective), n_points)


def _predict(theta: np.ndarray, tokens: float) -> np.ndarray:
    """The data law of each row of theta at `tokens`."""
    return theta[:, 0] + np.exp(theta[:, 1] - theta[:, 2] * np.log(tokens))


def _fits_and_refits(curves: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """For each (log x, log loss, multiplicities of the points in each resample): the fit to all points
    from the grid (theta and its summed Huber loss), and the resamples' refits from it (thetas)."""
    full = [(x, y, counts, *_fit(x, y)) for x, y, counts in curves]
    return [(theta[0], objective[0], _fit(x, y, theta[0], counts)[0]) for x, y, counts, theta, objective in full]


def fit_data_law(tokens, losses, start: DataLaw | None = None) -> DataLaw:
    """L(D) = E + B * D^-beta fitted to the points (several seeds per budget welcome), by Hoffmann et al.
    2022 approach 3 (see the module). `start`: a fit to start from instead of the grid. ConfigError:
    fewer than 3 budgets, or a value that is not finite and positive."""
    tokens, losses = _curve(tokens, losses)
    _require_budgets(tokens, "L(D) = E + B*D^-beta")
    start = None if start is None else _theta(start)
    (theta,), (objective,) = _fit(np.log(tokens)[:, None], np.log(losses), start)
    return _data_law(theta, objective, tokens.size)


def fit_joint_law(params, tokens, losses, start: JointLaw | None = None) -> JointLaw:
    """L(N, D) = E + A * N^-alpha + B * D^-beta, by the same method as `fit_data_law`. Needs 3 sizes
    (with two, E, A and alpha are not identified) and 3 budgets."""
    params = _positive_finite(params, "params")
    tokens, losses = _curve(tokens, losses)
    if params.shape != tokens.shape:
        raise ConfigError(f"fit: {params.size} parameter counts for {tokens.size} losses")
    if np.unique(params).size < MIN_SIZES:
        raise ConfigError(f"fit: L(N, D) needs at least {MIN_SIZES} model sizes, got {np.unique(params).size}")
    _require_budgets(tokens, "L(N, D)")
    log_x, start = np.log(np.column_stack([params, tokens])), None if start is None else _theta(start)
    (theta,), (objective,) = _fit(log_x, np.log(losses), start)
    return _joint_law(theta, objective, tokens.size)


def _group(items, key: Callable) -> dict:
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def check_points(points: Sequence[Point]) -> list[Point]:
    """The points as a list; ConfigError when there are none or a value is not finite and positive."""
    points = list(points)
    if not points:
        raise ConfigError("fit: no points to fit")
    for what in ("params", "tokens", "loss"):
        _positive_finite([getattr(p, what) for p in points], what)
    return points


def _stream(seed: int, *key) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(repr(tuple(map(str, key))).encode())])


class _Resampler:
    """Resamples as multiplicities (resamples x points): seeds drawn with replacement, then within each
    (variant, size) the points of each drawn seed with replacement. Variants with the same seed labels
    share the seed draws: runs of the same seed see the same data order, so their noise is paired.
    Points without a seed label form one seed. The seed draws come from a random stream per set of
    labels, the point draws from one per (variant, size): a size's resamples are the same whatever
    other sizes and variants are resampled with it."""

    def __init__(self, points: list[Point], seed: int, salt: str = ""):
        self.n, self.labels, self.groups = len(points), {}, []
        for variant, members in _group(range(len(points)), lambda i: points[i].variant).items():
            labels = tuple(sorted({points[i].seed for i in members}, key=str))
            self.labels.setdefault(labels, _stream(seed, salt, *labels))
            for params, group in _group(members, lambda i: points[i].params).items():
                strata = [[i for i in group if points[i].seed == label] for label in labels]
                table = np.zeros((len(labels), max(map(len, strata))), int)  # the points of each seed
                for row, stratum in zip(table, strata):
                    row[:len(stratum)] = stratum
                budgets = np.unique([points[i].tokens for i in group], return_inverse=True)[1]
                self.groups.append((labels, table, np.array([len(s) for s in strata]), budgets, group,
                                    _stream(seed, salt, variant, params)))

    def draw(self, resamples: int, need_budgets: bool) -> np.ndarray:
        """`need_budgets`: a (variant, size) left with fewer than 3 budgets has its points drawn again
        from the same seeds (after 20 tries, from seeds drawn again for it alone)."""
        counts = np.zeros((resamples, self.n), int)
        drawn = {labels: rng.integers(len(labels), size=(resamples, len(labels)))
                 for labels, rng in self.labels.items()}
        for labels, table, sizes, budgets, group, rng in self.groups:
            seeds, rows = drawn[labels].copy(), np.arange(resamples)
            for attempt in range(1000):
                for k in seeds[rows].T:  # one drawn seed per row: its points, with replacement
                    picks = (rng.random((len(rows), table.shape[1])) * sizes[k, None]).astype(int)
                    taken = np.arange(table.shape[1]) < sizes[k, None]
                    np.add.at(counts, (np.broadcast_to(rows[:, None], picks.shape)[taken],
                                       table[k[:, None], picks][taken]), 1)
                present = np.zeros((len(rows), budgets.max() + 1), bool)
                for column, budget in zip(group, budgets):
                    present[:, budget] |= counts[rows, column] > 0
                rows = rows[present.sum(axis=1) < MIN_BUDGETS] if need_budgets else rows[:0]
                if not rows.size:
                    break
                counts[np.ix_(rows, group)] = 0
                if attempt % 20 == 19:
                    seeds[rows] = rng.integers(len(labels), size=(len(rows), len(labels)))
            else:
                raise ConfigError("fit: bootstrap resamples keep leaving fewer than 3 budgets; "
                                  "measure more budgets or seeds")
        return counts


def _estimate(value: float, samples: np.ndarray) -> Estimate:
    low, high = np.percentile(samples, [2.5, 97.5])
    return Estimate(float(value), float(low), float(high))


def bootstrap(points: Sequence[Point], statistic: Callable[[list[Point]], Mapping[str, float]],
              resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Estimate]:
    """Each value of ``statistic(points)`` with its 95 % percentile interval over `resamples` resamples
    (see `_Resampler`: over seeds, then over the points of each seed) drawn from `seed`, so the same
    call gives the same intervals. Resamples on which the statistic raises ConfigError (e.g. a fit left
    fewer than 3 budgets) are drawn again. `fit_variants` and `held_out_checks` refit their resamples
    once for all their statistics instead."""
    points = check_points(points)
    values, resampler, samples, redrawn = statistic(points), _Resampler(points, seed), [], 0
    while len(samples) < resamples:
        for row in resampler.draw(resamples - len(samples), need_budgets=False):
            try:
                samples.append(statistic([p for p, n in zip(points, row) for _ in range(n)]))
            except ConfigError:
                redrawn += 1
                if redrawn > resamples:
                    raise ConfigError(f"fit: {redrawn} bootstrap resamples had too few budgets to fit; "
                                      "measure more budgets or seeds") from None
    return {key: _estimate(value, np.array([s[key] for s in samples])) for key, value in values.items()}


def fit_variants(points: Sequence[Point], budgets: Mapping[str, float] = DEFAULT_BUDGETS,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = 0, joint: bool = True) -> list[VariantFit]:
    """Per variant (in order of first appearance): the data law of each size with intervals for "E",
    "beta" and "loss at <budget name>" (budgets in tokens per parameter), and (`joint`) the joint law
    with intervals for "E", "alpha", "beta" when the variant has 3 sizes or more. All intervals come
    from one set of `resamples` resamples (see `_Resampler`; a size left fewer than 3 budgets has its
    points drawn again), refitted from the fits to all points; `fit_gaps` takes them on to the gaps."""
    points = check_points(points)
    variants = _group(range(len(points)), lambda i: points[i].variant)
    sizes = [(variant, params, group) for variant, members in variants.items()
             for params, group in sorted(_group(members, lambda i: points[i].params).items())]
    for _, _, group in sizes:
        _require_budgets([points[i].tokens for i in group], "L(D) = E + B*D^-beta")
    counts = _Resampler(points, seed).draw(resamples, need_budgets=True)
    curves = [(np.log([[points[i].tokens] for i in group]), np.log([points[i].loss for i in group]), counts[:, group])
              for _, _, group in sizes]
    fits: dict[str, list[SizeFit]] = {variant: [] for variant in variants}
    for (variant, params, group), (theta, objective, refits) in zip(sizes, _fits_and_refits(curves)):
        law, named = _data_law(theta, objective, len(group)), {f"loss at {n}": r * params for n, r in budgets.items()}
        samples = {"E": refits[:, 0], "beta": refits[:, 2], **{k: _predict(refits, d) for k, d in named.items()}}
        values = {"E": law.E, "beta": law.beta, **{k: float(law.predict(d)) for k, d in named.items()}}
        fits[variant].append(SizeFit(params, len({points[i].tokens for i in group}), law,
                                     {k: _estimate(values[k], samples[k]) for k in values}, samples))
    joints = [variant for variant in variants if joint and len(fits[variant]) >= MIN_SIZES]
    curves = [(np.log([[points[i].params, points[i].tokens] for i in variants[v]]),
               np.log([points[i].loss for i in variants[v]]), counts[:, variants[v]]) for v in joints]
    joint_fits = {}
    for variant, (theta, objective, refits) in zip(joints, _fits_and_refits(curves)):
        law = _joint_law(theta, objective, len(variants[variant]))
        joint_fits[variant] = (law, {key: _estimate(getattr(law, key), refits[:, column])
                                     for key, column in (("E", 0), ("alpha", 2), ("beta", 4))})
    return [VariantFit(v, tuple(fits[v]), *joint_fits.get(v, (None, {}))) for v in variants]


def fit_gaps(fits: Sequence[VariantFit], a: str, b: str, budgets: Mapping[str, float] = DEFAULT_BUDGETS) -> list[Gap]:
    """Variant `a`'s fitted loss minus variant `b`'s at each budget (those given to `fit_variants`), per
    model size both have, from fits of one `fit_variants` call, resample by resample: the interval
    carries the noise of both and their pairing (the same seeds drawn for both, when their seed labels
    are the same)."""
    by_variant = {fit.variant: {size.params: size for size in fit.sizes} for fit in fits}
    common = sorted(set(by_variant[a]) & set(by_variant[b]))
    if not common:
        raise ConfigError(f"fit: variants {a!r} and {b!r} have no model size in common")
    return [Gap(a, b, params, name, ratio * params, _estimate(
                float(size_a.law.predict(ratio * params) - size_b.law.predict(ratio * params)),
                size_a.samples[f"loss at {name}"] - size_b.samples[f"loss at {name}"]))
            for params in common for size_a, size_b in [(by_variant[a][params], by_variant[b][params])]
            for name, ratio in budgets.items()]


def gap(points: Sequence[Point], a: str, b: str, budgets: Mapping[str, float] = DEFAULT_BUDGETS,
        resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> list[Gap]:
    """`fit_gaps` of variants `a` and `b` at the model sizes both have: the same intervals as
    `fit_variants` (with the same `seed`, whatever other variants it fits) and `fit_gaps` give."""
    points = [p for p in check_points(points) if p.variant in (a, b)]
    common = {p.params for p in points if p.variant == a} & {p.params for p in points if p.variant == b}
    if not common:
        raise ConfigError(f"fit: variants {a!r} and {b!r} have no model size in common")
    fits = fit_variants([p for p in points if p.params in common], budgets, resamples, seed, joint=False)
    return fit_gaps(fits, a, b, budgets)


def held_out_checks(points: Sequence[Point], resamples: int = DEFAULT_RESAMPLES,
                    seed: int = 0) -> dict[tuple[str, float], HeldOutCheck | ConfigError]:
    """`held_out_check` of each (variant, size) of the points, on resamples drawn once: per (variant,
    params), the check or the ConfigError that says why there is none."""
    results: dict[tuple[str, float], HeldOutCheck | ConfigError] = {}
    cases, curves = [], []
    for key, group in _group(check_points(points), lambda p: (p.variant, p.params)).items():
        largest = max(p.tokens for p in group)
        # "half": within the rounding of budgets to whole optimizer steps (a study's 10 and 20 tokens/param)
        fitted = [p for p in group if p.tokens <= largest / 2 * HALF_TOLERANCE]
        try:
            _require_budgets([p.tokens for p in fitted], "the held-out check (on budgets up to half the largest)")
        except ConfigError as error:
            results[key] = error
            continue
        cases.append((key, fitted, largest, [p.loss for p in group if p.tokens == largest]))
        curves.append((np.log([[p.tokens] for p in fitted]), np.log([p.loss for p in fitted]),
                       _Resampler(fitted, seed, "held out").draw(resamples, need_budgets=True)))
    for (key, fitted, largest, measured), (log_tokens, log_loss, counts), (theta, objective, refits) in zip(
            cases, curves, _fits_and_refits(curves)):
        law = _data_law(theta, objective, len(fitted))
        # per resample, one log residual of its refit per measured run, drawn from its points
        residuals = log_loss - np.log(refits[:, :1] + np.exp(refits[:, 1:2] - refits[:, 2:] * log_tokens[:, 0]))
        drawn = _stream(seed, "held-out noise", *key).random((resamples, len(measured))) * counts.sum(1, keepdims=True)
        picks = (counts.cumsum(axis=1)[:, None, :] <= drawn.astype(int)[:, :, None]).sum(axis=2)
        samples = _predict(refits, largest) * np.exp(np.take_along_axis(residuals, picks, axis=1)).mean(axis=1)
        results[key] = HeldOutCheck(key[0], key[1], largest, max(p.tokens for p in fitted), _estimate(
            float(law.predict(largest)), samples), float(np.mean(measured)), len(measured))
    return results


def held_out_check(points: Sequence[Point], resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> HeldOutCheck:
    """Fit the data law on the budgets up to half the largest (of one variant and size), predict the
    largest, and compare with the mean loss measured there. The interval is a prediction interval for
    that mean: each resample's prediction times exp of log residuals of its fit drawn at random, one per
    measured run, averaged, so that it holds the measurement noise as well as the fit's."""
    points = check_points(points)
    if len({(p.variant, p.params) for p in points}) > 1:
        raise ConfigError("fit: held_out_check takes the points of one variant and one model size")
    (check,) = held_out_checks(points, resamples, seed).values()
    if isinstance(check, ConfigError):
        raise check
    return check


def tail_slope(tokens, losses, noise: float | None = None) -> TailSlope:
    """Whether a single run's validation loss is still falling at its end, without a frontier to fit:
    the least-squares slope of loss on log2(tokens) over the last quarter of the run's tokens (the
    evaluations at tokens >= 0.75 x the last), i.e. the loss change per doubling of tokens, and its
    standard error. `still_falling`: the slope is negative and larger in magnitude than `noise`, a loss
    difference that counts as noise (e.g. the spread of the final loss across seeds: one more doubling
    would gain more than that); without it, 2 x the standard error of the slope."""
    tokens, losses = _curve(tokens, losses)
    tail = tokens >= (1 - TAIL_FRACTION) * tokens.max()
    if np.unique(tokens[tail]).size < 3:
        raise ConfigError(f"fit: the last quarter of the run holds {np.unique(tokens[tail]).size} evaluations, "
                          "the tail slope needs 3")
    if noise is not None and not (np.isfinite(noise) and noise >= 0):
        raise ConfigError(f"fit: noise must be finite and >= 0, got {noise!r}")
    x, y = np.log2(tokens[tail]), losses[tail]
    centred = x - x.mean()
    slope = float(centred @ y / (centred @ centred))
    residual = y - y.mean() - slope * centred
    stderr = float(np.sqrt(residual @ residual / (x.size - 2) / (centred @ centred)))
    threshold = 2 * stderr if noise is None else float(noise)
    return TailSlope(slope, stderr, threshold, int(x.size), slope < 0 and -slope > threshold)
