"""Checks of a fit against measurements: a data law fitted on the smaller budgets, against the loss
measured at the largest (`held_out_check`), and whether a single run's loss is still falling at its
end (`tail_slope`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ropelab.config import ConfigError
from ropelab.study.bootstrap import DEFAULT_RESAMPLES, MIN_SEEDS, Estimate, Resampler, group_by, random_stream
from ropelab.study.fit import (DataLaw, Point, check_points, checked_curve, fits_and_refits, predict_data_laws,
                               require_budgets)

__all__ = ["HeldOutCheck", "TailSlope", "held_out_check", "held_out_checks", "tail_slope"]

HALF_TOLERANCE = 1.01
TAIL_FRACTION = 0.25


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
        if not self.predicted.has_interval:
            verdict = f"not judged (intervals need at least {MIN_SEEDS} seeds)"
        else:
            verdict = ("inside" if self.inside else "OUTSIDE") + " the interval"
        return (f"held-out check {self.variant} N={self.params:.3g}: fit on D <= {self.fitted_up_to:.3g}, "
                f"predicted L({self.tokens:.3g}) = {self.predicted}, measured {self.measured:.4g} "
                f"(mean of {self.n_measured}): {verdict}")


@dataclass(frozen=True)
class TailSlope:
    """Loss per doubling of tokens over the last quarter of a run; see `tail_slope`."""
    slope: float
    stderr: float
    noise: float
    n_points: int
    still_falling: bool


def held_out_checks(points: Sequence[Point], resamples: int = DEFAULT_RESAMPLES,
                    seed: int = 0) -> dict[tuple[str, float], HeldOutCheck | ConfigError]:
    """`held_out_check` of each (variant, size) of the points, on resamples drawn once: per (variant,
    params), the check or the ConfigError that says why there is none."""
    results: dict[tuple[str, float], HeldOutCheck | ConfigError] = {}
    cases, curves = [], []
    for key, group in group_by(check_points(points), lambda p: (p.variant, p.params)).items():
        largest = max(p.tokens for p in group)
        # "half": within the rounding of budgets to whole optimizer steps (a study's 10 and 20 tokens/param)
        fitted = [p for p in group if p.tokens <= largest / 2 * HALF_TOLERANCE]
        try:
            require_budgets([p.tokens for p in fitted], "the held-out check (on budgets up to half the largest)")
        except ConfigError as error:
            results[key] = error
            continue
        cases.append((key, fitted, largest, [p.loss for p in group if p.tokens == largest]))
        curves.append((np.log([[p.tokens] for p in fitted]), np.log([p.loss for p in fitted]),
                       Resampler(fitted, seed, "held out").draw(resamples, need_budgets=True)))
    for (key, fitted, largest, measured), (log_tokens, log_loss, counts), (theta, objective, refits) in zip(
            cases, curves, fits_and_refits(curves)):
        law = DataLaw.from_theta(theta, objective, len(fitted))
        # per resample, one log residual of its refit per measured run, drawn from its points
        residuals = log_loss - np.log(refits[:, :1] + np.exp(refits[:, 1:2] - refits[:, 2:] * log_tokens[:, 0]))
        drawn = random_stream(seed, "held-out noise", *key).random((resamples, len(measured))) * counts.sum(1, keepdims=True)
        picks = (counts.cumsum(axis=1)[:, None, :] <= drawn.astype(int)[:, :, None]).sum(axis=2)
        samples = predict_data_laws(refits, largest) * np.exp(np.take_along_axis(residuals, picks, axis=1)).mean(axis=1)
        results[key] = HeldOutCheck(key[0], key[1], largest, max(p.tokens for p in fitted), Estimate.from_samples(
            float(law.predict(largest)), samples, len({p.seed for p in fitted})), float(np.mean(measured)), len(measured))
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
    tokens, losses = checked_curve(tokens, losses)
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
