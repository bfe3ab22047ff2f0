"""Scaling-law fits with bootstrap uncertainty, for studies that train at several token budgets.

The fits follow Hoffmann et al. 2022 (Chinchilla), approach 3: minimise the Huber loss (delta 1e-3)
of the log residuals, with the law written as a logsumexp so that the optimiser works on
``e = log E``, ``b = log B``, ...:

    log L(D)    = logsumexp(b - beta * log D, e)                      (`fit_data_law`)
    log L(N, D) = logsumexp(a - alpha * log N, b - beta * log D, e)   (`fit_joint_law`)

with L-BFGS-B started from the best points of a grid, keeping the best optimum. Besiroglu et al.
2024 (Chinchilla scaling: a replication attempt) refitted approach 3 and found the published
intervals implausibly narrow and the fit itself off, most likely from the optimiser stopping early.
So the optimiser runs to tight tolerances here (see `_minimise`), and every fit comes with 95 %
percentile bootstrap intervals (`bootstrap`) over the seeds and over the points of each seed.

A study's measurements are `Point`s (a variant, a seed, N = non-embedding parameters, D = training
tokens, the loss at the end of that run). Budgets are named in tokens per parameter, as in
Chinchilla's 20 tokens per parameter: ``{"20 tokens/param": 20.0}`` predicts at D = 20 * N.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import huber

from ropelab.config import ConfigError

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_RESAMPLES", "DataLaw", "Estimate", "Gap", "HeldOutCheck", "JointLaw",
           "Point", "SizeFit", "TailSlope", "VariantFit", "bootstrap", "check_points", "fit_data_law", "fit_joint_law",
           "fit_variants", "gap", "held_out_check", "tail_slope"]

HUBER_DELTA = 1e-3
# Chinchilla's grid of starting points: e = log E, the log coefficients, the exponents
LOG_E_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5)
LOG_COEFFICIENT_GRID = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
EXPONENT_GRID = (0.0, 0.5, 1.0, 1.5, 2.0)
STARTS = 12  # L-BFGS-B runs from the 12 grid points of lowest objective, not from all 5400 of the joint law
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
    "loss at <budget name>"."""
    params: float
    n_budgets: int
    law: DataLaw
    estimates: dict[str, Estimate]


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


def _require_budgets(tokens: np.ndarray, what: str) -> None:
    if np.unique(tokens).size < MIN_BUDGETS:
        raise ConfigError(f"fit: {what} needs at least {MIN_BUDGETS} distinct token budgets, "
                          f"got {np.unique(tokens).size}")


def _objective(theta: np.ndarray, log_x: np.ndarray, log_loss: np.ndarray) -> tuple[float, np.ndarray]:
    """Summed Huber loss of the log residuals and its gradient; theta = [e, c_1, p_1, ..., c_k, p_k]
    for log L = logsumexp(e, c_j - p_j * log x_j)."""
    terms = np.column_stack([np.full(len(log_loss), theta[0]), theta[1::2] - theta[2::2] * log_x])
    log_pred = np.logaddexp.reduce(terms, axis=1)  # logsumexp; scipy's costs 30x more on a few points
    weights = np.exp(terms - log_pred[:, None])
    residual = log_pred - log_loss
    slope = np.clip(residual, -HUBER_DELTA, HUBER_DELTA)  # d huber / d residual
    gradient = np.empty_like(theta)
    gradient[0] = slope @ weights[:, 0]
    gradient[1::2] = slope @ weights[:, 1:]
    gradient[2::2] = -slope @ (weights[:, 1:] * log_x)
    return float(huber(HUBER_DELTA, residual).sum()), gradient


def _minimise(log_x: np.ndarray, log_loss: np.ndarray, start: np.ndarray | None) -> tuple[np.ndarray, float]:
    """The best L-BFGS-B optimum from `start`, or from the grid points of lowest objective."""
    if start is not None:
        starts = start[None, :]
    else:
        powers = [LOG_E_GRID] + [LOG_COEFFICIENT_GRID, EXPONENT_GRID] * log_x.shape[1]
        grid = np.array(list(itertools.product(*powers)))
        terms = np.concatenate([np.broadcast_to(grid[:, None, :1], (len(grid), len(log_loss), 1)),
                                grid[:, None, 1::2] - grid[:, None, 2::2] * log_x[None]], axis=2)
        grid_objective = huber(HUBER_DELTA, np.logaddexp.reduce(terms, axis=2) - log_loss).sum(axis=1)
        starts = grid[np.argsort(grid_objective, kind="stable")[:STARTS]]
    bounds = [(None, None)] + [(None, None), (0.0, None)] * log_x.shape[1]  # the loss never rises with N or D
    best = None
    for theta in starts:
        # tight tolerances: the objective is ~1e-5, and the default ftol (relative to max(|f|, 1)) stops at
        # the start, which made the bootstrap's refits stay at the full fit and its intervals far too narrow
        result = minimize(_objective, theta, args=(log_x, log_loss), jac=True, method="L-BFGS-B", bounds=bounds,
                          options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000})
        if best is None or result.fun < best.fun:
            best = result
    return best.x, float(best.fun)


def fit_data_law(tokens, losses, start: DataLaw | None = None) -> DataLaw:
    """L(D) = E + B * D^-beta fitted to the points (several seeds per budget welcome), by Hoffmann et al.
    2022 approach 3 (see the module). `start`: a fit to start from instead of the grid (the bootstrap's
    refits start from the fit to all points). ConfigError: fewer than 3 budgets, or a value that is not
    finite and positive."""
    tokens, losses = _curve(tokens, losses)
    _require_budgets(tokens, "L(D) = E + B*D^-beta")
    theta0 = None if start is None else np.array([np.log(start.E), np.log(start.B), start.beta])
    theta, objective = _minimise(np.log(tokens)[:, None], np.log(losses), theta0)
    return DataLaw(float(np.exp(theta[0])), float(np.exp(theta[1])), float(theta[2]), objective, tokens.size)


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
    theta0 = None if start is None else np.array(
        [np.log(start.E), np.log(start.A), start.alpha, np.log(start.B), start.beta])
    theta, objective = _minimise(np.log(np.column_stack([params, tokens])), np.log(losses), theta0)
    e, a, alpha, b, beta = (float(v) for v in theta)
    return JointLaw(float(np.exp(e)), float(np.exp(a)), alpha, float(np.exp(b)), beta, objective, tokens.size)


def _group(points: Sequence[Point], key: Callable[[Point], object]) -> dict[object, list[Point]]:
    groups: dict[object, list[Point]] = {}
    for point in points:
        groups.setdefault(key(point), []).append(point)
    return groups


def check_points(points: Sequence[Point]) -> list[Point]:
    """The points as a list; ConfigError when there are none or a value is not finite and positive."""
    points = list(points)
    if not points:
        raise ConfigError("fit: no points to fit")
    for what in ("params", "tokens", "loss"):
        _positive_finite([getattr(p, what) for p in points], what)
    return points


def _arrays(points: Sequence[Point]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([p.tokens for p in points]), np.array([p.loss for p in points])


def _resample(points: list[Point], rng: np.random.Generator) -> list[Point]:
    """Seeds drawn with replacement, then the points of each drawn seed drawn with replacement within
    each (variant, size). Variants that share their seed labels share the seed draws: runs of the same
    seed see the same data order, so their noise is paired. Points without a seed label form one seed."""
    by_variant = _group(points, lambda p: p.variant)
    seeds = {variant: sorted({p.seed for p in members}, key=str) for variant, members in by_variant.items()}
    shared = len({tuple(map(str, labels)) for labels in seeds.values()}) == 1
    first = next(iter(seeds.values()))
    shared_draw = rng.integers(len(first), size=len(first)) if shared else None
    drawn = []
    for variant, members in by_variant.items():
        labels = seeds[variant]
        for k in shared_draw if shared else rng.integers(len(labels), size=len(labels)):
            for stratum in _group([p for p in members if p.seed == labels[k]], lambda p: p.params).values():
                drawn.extend(stratum[i] for i in rng.integers(len(stratum), size=len(stratum)))
    return drawn


def _bootstrap_samples(points: list[Point], statistic: Callable[[list[Point]], Mapping[str, float]],
                       resamples: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    samples: list[Mapping[str, float]] = []
    redrawn = 0
    while len(samples) < resamples:
        try:
            samples.append(statistic(_resample(points, rng)))
        except ConfigError:  # the resample left a fit fewer than 3 budgets: draw another
            redrawn += 1
            if redrawn > resamples:
                raise ConfigError(f"fit: {redrawn} bootstrap resamples had too few budgets to fit; "
                                  "measure more budgets or seeds") from None
    return {key: np.array([s[key] for s in samples]) for key in samples[0]}


def _estimate(value: float, samples: np.ndarray) -> Estimate:
    low, high = np.percentile(samples, [2.5, 97.5])
    return Estimate(float(value), float(low), float(high))


def bootstrap(points: Sequence[Point], statistic: Callable[[list[Point]], Mapping[str, float]],
              resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Estimate]:
    """Each value of ``statistic(points)`` with its 95 % percentile interval over `resamples` resamples
    (see `_resample`: over seeds, then over the points of each seed), drawn from
    ``numpy.random.default_rng(seed)``, so the same call gives the same intervals. Resamples that leave
    a fit fewer than 3 budgets (the statistic raises ConfigError) are drawn again."""
    points = check_points(points)
    values = statistic(points)
    samples = _bootstrap_samples(points, statistic, resamples, seed)
    return {key: _estimate(value, samples[key]) for key, value in values.items()}


def _data_law_statistic(law: DataLaw, params: float, budgets: Mapping[str, float]):
    def statistic(points: list[Point]) -> dict[str, float]:
        refit = fit_data_law(*_arrays(points), start=law)
        return {"E": refit.E, "beta": refit.beta,
                **{f"loss at {name}": float(refit.predict(ratio * params)) for name, ratio in budgets.items()}}
    return statistic


def _joint_law_statistic(law: JointLaw):
    def statistic(points: list[Point]) -> dict[str, float]:
        refit = fit_joint_law([p.params for p in points], *_arrays(points), start=law)
        return {"E": refit.E, "alpha": refit.alpha, "beta": refit.beta}
    return statistic


def fit_variants(points: Sequence[Point], budgets: Mapping[str, float] = DEFAULT_BUDGETS,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> list[VariantFit]:
    """Per variant (in order of first appearance): the data law of each size with intervals for "E",
    "beta" and "loss at <budget name>" (budgets in tokens per parameter), and the joint law with
    intervals for "E", "alpha", "beta" when the variant has 3 sizes or more."""
    points = check_points(points)
    fits = []
    for variant, members in _group(points, lambda p: p.variant).items():
        sizes = []
        for params, group in sorted(_group(members, lambda p: p.params).items()):
            law = fit_data_law(*_arrays(group))
            estimates = bootstrap(group, _data_law_statistic(law, params, budgets), resamples, seed)
            sizes.append(SizeFit(params, len({p.tokens for p in group}), law, estimates))
        joint, joint_estimates = None, {}
        if len(sizes) >= MIN_SIZES:
            joint = fit_joint_law([p.params for p in members], *_arrays(members))
            joint_estimates = bootstrap(members, _joint_law_statistic(joint), resamples, seed)
        fits.append(VariantFit(variant, tuple(sizes), joint, joint_estimates))
    return fits


def _gap_statistic(a: str, b: str, laws: dict[str, DataLaw], params: float, budgets: Mapping[str, float]):
    def statistic(points: list[Point]) -> dict[str, float]:
        refits = {v: fit_data_law(*_arrays([p for p in points if p.variant == v]), start=laws[v]) for v in (a, b)}
        return {name: float(refits[a].predict(ratio * params) - refits[b].predict(ratio * params))
                for name, ratio in budgets.items()}
    return statistic


def gap(points: Sequence[Point], a: str, b: str, budgets: Mapping[str, float] = DEFAULT_BUDGETS,
        resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> list[Gap]:
    """Variant `a`'s fitted loss minus variant `b`'s at each budget, per model size both have; both data
    laws are refitted on each resample, so the interval carries the noise of both and their pairing."""
    points = [p for p in check_points(points) if p.variant in (a, b)]
    sizes = sorted({p.params for p in points if p.variant == a} & {p.params for p in points if p.variant == b})
    if not sizes:
        raise ConfigError(f"fit: variants {a!r} and {b!r} have no model size in common")
    gaps = []
    for params in sizes:
        group = [p for p in points if p.params == params]
        laws = {v: fit_data_law(*_arrays([p for p in group if p.variant == v])) for v in (a, b)}
        estimates = bootstrap(group, _gap_statistic(a, b, laws, params, budgets), resamples, seed)
        gaps.extend(Gap(a, b, params, name, ratio * params, estimates[name]) for name, ratio in budgets.items())
    return gaps


def held_out_check(points: Sequence[Point], resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> HeldOutCheck:
    """Fit the data law on the budgets up to half the largest (of one variant and size), predict the
    largest, and compare with the mean loss measured there. The interval is a prediction interval for
    that mean: each resample's prediction times exp of log residuals of its fit drawn at random, one per
    measured run, averaged, so that it holds the measurement noise as well as the fit's."""
    points = check_points(points)
    if len({(p.variant, p.params) for p in points}) > 1:
        raise ConfigError("fit: held_out_check takes the points of one variant and one model size")
    largest = max(p.tokens for p in points)
    fitted = [p for p in points if p.tokens <= largest / 2]
    _require_budgets(np.array([p.tokens for p in fitted]), "the held-out check (on budgets up to half the largest)")
    measured = [p.loss for p in points if p.tokens == largest]
    law = fit_data_law(*_arrays(fitted))
    noise_rng = np.random.default_rng([seed, 1])  # a stream of its own, apart from the resampling

    def statistic(resampled: list[Point]) -> dict[str, float]:
        tokens, losses = _arrays(resampled)
        refit = fit_data_law(tokens, losses, start=law)
        residuals = np.log(losses) - np.log(refit.predict(tokens))
        runs = refit.predict(largest) * np.exp(noise_rng.choice(residuals, size=len(measured)))
        return {"mean": float(runs.mean())}

    samples = _bootstrap_samples(fitted, statistic, resamples, seed)["mean"]
    return HeldOutCheck(points[0].variant, points[0].params, largest, max(p.tokens for p in fitted),
                        _estimate(float(law.predict(largest)), samples), float(np.mean(measured)), len(measured))


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
