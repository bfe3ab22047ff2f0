"""Scaling-law fits per variant and model size with bootstrap intervals, and the gaps between variants.

One set of resamples (`ropelab.study.bootstrap.Resampler`) serves every statistic of `fit_variants`:
each size's data law and named budgets, the variant's joint law, and the gaps between variants
(`fit_gaps`), instead of a set, and its refits, per statistic. A report of 5 variants x 3 sizes x 4
budgets x 2 seeds (400 resamples) takes about a CPU minute, nearly all of it in scipy's ~14,000
L-BFGS-B runs. The laws and their fit are `ropelab.study.fit`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ropelab.config import ConfigError
from ropelab.study.bootstrap import DEFAULT_RESAMPLES, Estimate, Resampler, group_by
from ropelab.study.fit import (MIN_SIZES, DataLaw, JointLaw, Point, check_points, fits_and_refits, predict_data_laws,
                               require_budgets)

__all__ = ["DEFAULT_BUDGETS", "Gap", "SizeFit", "VariantFit", "fit_gaps", "fit_variants", "gap"]

DEFAULT_BUDGETS: Mapping[str, float] = {"20 tokens/param": 20.0}


@dataclass(frozen=True)
class SizeFit:
    """The data law of one model size, fitted to the token `budgets` measured; `estimates` holds "E",
    "beta" and "loss at <budget name>", `samples` their bootstrap values, resample by resample."""
    params: float
    budgets: tuple[float, ...]  # distinct, ascending
    law: DataLaw
    estimates: dict[str, Estimate]
    samples: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_budgets(self) -> int:
        return len(self.budgets)


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


def fit_variants(points: Sequence[Point], budgets: Mapping[str, float] = DEFAULT_BUDGETS,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = 0, joint: bool = True) -> list[VariantFit]:
    """Per variant (in order of first appearance): the data law of each size with intervals for "E",
    "beta" and "loss at <budget name>" (budgets in tokens per parameter), and (`joint`) the joint law
    with intervals for "E", "alpha", "beta" when the variant has 3 sizes or more. All intervals come
    from one set of `resamples` resamples (see `Resampler`; a size left fewer than 3 budgets has its
    points drawn again), refitted from the fits to all points; `fit_gaps` takes them on to the gaps."""
    points = check_points(points)
    variants = group_by(range(len(points)), lambda i: points[i].variant)
    sizes = [(variant, params, group) for variant, members in variants.items()
             for params, group in sorted(group_by(members, lambda i: points[i].params).items())]
    for _, _, group in sizes:
        require_budgets([points[i].tokens for i in group], "L(D) = E + B*D^-beta")
    counts = Resampler(points, seed).draw(resamples, need_budgets=True)
    curves = [(np.log([[points[i].tokens] for i in group]), np.log([points[i].loss for i in group]), counts[:, group])
              for _, _, group in sizes]
    fits: dict[str, list[SizeFit]] = {variant: [] for variant in variants}
    for (variant, params, group), (theta, objective, refits) in zip(sizes, fits_and_refits(curves)):
        law, named = DataLaw.from_theta(theta, objective, len(group)), {f"loss at {n}": r * params for n, r in budgets.items()}
        samples = {"E": refits[:, 0], "beta": refits[:, 2], **{k: predict_data_laws(refits, d) for k, d in named.items()}}
        values = {"E": law.E, "beta": law.beta, **{k: float(law.predict(d)) for k, d in named.items()}}
        seeds = len({points[i].seed for i in group})
        fits[variant].append(SizeFit(params, tuple(sorted({points[i].tokens for i in group})), law,
                                     {k: Estimate.from_samples(values[k], samples[k], seeds) for k in values}, samples))
    joints = [variant for variant in variants if joint and len(fits[variant]) >= MIN_SIZES]
    curves = [(np.log([[points[i].params, points[i].tokens] for i in variants[v]]),
               np.log([points[i].loss for i in variants[v]]), counts[:, variants[v]]) for v in joints]
    joint_fits = {}
    for variant, (theta, objective, refits) in zip(joints, fits_and_refits(curves)):
        law = JointLaw.from_theta(theta, objective, len(variants[variant]))
        seeds = len({points[i].seed for i in variants[variant]})
        joint_fits[variant] = (law, {key: Estimate.from_samples(getattr(law, key), refits[:, column], seeds)
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
    gaps = []
    for params in common:
        size_a, size_b = by_variant[a][params], by_variant[b][params]
        for name, ratio in budgets.items():
            key = f"loss at {name}"
            gaps.append(Gap(a, b, params, name, ratio * params, Estimate.from_samples(
                float(size_a.law.predict(ratio * params) - size_b.law.predict(ratio * params)),
                size_a.samples[key] - size_b.samples[key], min(size_a.estimates[key].seeds, size_b.estimates[key].seeds))))
    return gaps


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

