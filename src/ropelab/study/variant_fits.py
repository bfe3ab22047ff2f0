"""Scaling-law fits per variant and model size with bootstrap intervals, and the gaps between variants.

One set of resamples (`ropelab.study.bootstrap.Resampler`) serves every statistic of `fit_variants`:
each size's data law and named budgets, the variant's joint law, and the gaps between variants
(`fit_gaps`), instead of a set, and its refits, per statistic. A report of 5 variants x 3 sizes x 4
budgets x 2 seeds (400 resamples) takes about a CPU minute, nearly all of it in scipy's ~14,000
L-BFGS-B runs. The laws and their fit are `ropelab.study.fit`; each fitted law also carries the
profiles of E and its exponents (`ropelab.study.fit_profiles`: about 25 refits per parameter, a few
percent of the bootstrap's time), which say whether the data identify them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ropelab.config import ConfigError
from ropelab.study.bootstrap import DEFAULT_RESAMPLES, Estimate, Resampler, group_by
from ropelab.study.fit import (MIN_SIZES, DataLaw, JointLaw, Point, check_points, fits_and_refits, predict_data_laws,
                               predict_joint_laws, require_budgets)
from ropelab.study.fit_profiles import Profile, law_profiles

__all__ = ["DEFAULT_BUDGETS", "Gap", "SizeFit", "VariantFit", "fit_gaps", "fit_variants", "gap", "joint_gap"]

DEFAULT_BUDGETS: Mapping[str, float] = {"20 tokens/param": 20.0}


@dataclass(frozen=True)
class SizeFit:
    """The data law of one model size, fitted to the token `budgets` measured; `estimates` holds "E",
    "beta" and "loss at <budget name>", `samples` their bootstrap values, resample by resample;
    `profiles` those of "E" and "beta" (empty when not asked for)."""
    params: float
    budgets: tuple[float, ...]  # distinct, ascending
    law: DataLaw
    estimates: dict[str, Estimate]
    samples: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    profiles: dict[str, Profile] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_budgets(self) -> int:
        return len(self.budgets)


@dataclass(frozen=True)
class VariantFit:
    """A variant's data law per size, and its joint law (with "E", "alpha", "beta" intervals) when it has
    at least 3 sizes: `joint_samples` holds the joint law's refit per resample (resamples x [E, log A,
    alpha, log B, beta]; the resamples of every variant of one `fit_variants` call are paired),
    `joint_profiles` the profiles of "E", "alpha" and "beta"."""
    variant: str
    sizes: tuple[SizeFit, ...]
    joint: JointLaw | None
    joint_estimates: dict[str, Estimate]
    joint_samples: np.ndarray | None = field(default=None, repr=False, compare=False)
    joint_profiles: dict[str, Profile] = field(default_factory=dict, repr=False, compare=False)

    def identified(self, name: str) -> bool:
        """The joint law's parameter `name` is identified by its profile (False without a joint law)."""
        return name in self.joint_profiles and self.joint_profiles[name].identified


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
                 resamples: int = DEFAULT_RESAMPLES, seed: int = 0, joint: bool = True,
                 profiles: bool = True) -> list[VariantFit]:
    """Per variant (in order of first appearance): the data law of each size with intervals for "E",
    "beta" and "loss at <budget name>" (budgets in tokens per parameter), and (`joint`) the joint law
    with intervals for "E", "alpha", "beta" when the variant has 3 sizes or more. All intervals come
    from one set of `resamples` resamples (see `Resampler`; a size left fewer than 3 budgets has its
    points drawn again), refitted from the fits to all points; `fit_gaps` takes them on to the gaps.
    `profiles`: each law's parameter profiles (`ropelab.study.fit_profiles`)."""
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
    for (variant, params, group), (x, y, _), (theta, objective, refits) in zip(sizes, curves, fits_and_refits(curves)):
        law, named = DataLaw.from_theta(theta, objective, len(group)), {f"loss at {n}": r * params for n, r in budgets.items()}
        samples = {"E": refits[:, 0], "beta": refits[:, 2], **{k: predict_data_laws(refits, d) for k, d in named.items()}}
        values = {"E": law.E, "beta": law.beta, **{k: float(law.predict(d)) for k, d in named.items()}}
        seeds = len({points[i].seed for i in group})
        fits[variant].append(SizeFit(params, tuple(sorted({points[i].tokens for i in group})), law,
                                     {k: Estimate.from_samples(values[k], samples[k], seeds) for k in values}, samples,
                                     law_profiles(x, y, theta, objective) if profiles else {}))
    joints = [variant for variant in variants if joint and len(fits[variant]) >= MIN_SIZES]
    curves = [(np.log([[points[i].params, points[i].tokens] for i in variants[v]]),
               np.log([points[i].loss for i in variants[v]]), counts[:, variants[v]]) for v in joints]
    joint_fits = {}
    for variant, (x, y, _), (theta, objective, refits) in zip(joints, curves, fits_and_refits(curves)):
        law = JointLaw.from_theta(theta, objective, len(variants[variant]))
        seeds = len({points[i].seed for i in variants[variant]})
        joint_fits[variant] = (law, {key: Estimate.from_samples(getattr(law, key), refits[:, column], seeds)
                                     for key, column in (("E", 0), ("alpha", 2), ("beta", 4))},
                               refits, law_profiles(x, y, theta, objective) if profiles else {})
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


def joint_gap(fits: Sequence[VariantFit], a: str, b: str, params: float, tokens: float) -> Estimate:
    """Variant `a`'s joint law minus variant `b`'s at N = `params`, D = `tokens` (anywhere, extrapolated
    too: the caller says whether the laws' exponents are identified), with its 95 % interval over the
    paired resamples of one `fit_variants` call. ConfigError when either has no joint law."""
    by_variant = {fit.variant: fit for fit in fits}
    missing = [v for v in (a, b) if by_variant[v].joint is None]
    if missing:
        raise ConfigError(f"fit: variant {missing[0]!r} has no joint law L(N, D) (it needs {MIN_SIZES} sizes)")
    fit_a, fit_b = by_variant[a], by_variant[b]
    value = float(fit_a.joint.predict(params, tokens) - fit_b.joint.predict(params, tokens))
    samples = predict_joint_laws(fit_a.joint_samples, params, tokens) - predict_joint_laws(fit_b.joint_samples, params, tokens)
    seeds = min(fit_a.joint_estimates["alpha"].seeds, fit_b.joint_estimates["alpha"].seeds)
    return Estimate.from_samples(value, samples, seeds)


def gap(points: Sequence[Point], a: str, b: str, budgets: Mapping[str, float] = DEFAULT_BUDGETS,
        resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> list[Gap]:
    """`fit_gaps` of variants `a` and `b` at the model sizes both have: the same intervals as
    `fit_variants` (with the same `seed`, whatever other variants it fits) and `fit_gaps` give."""
    points = [p for p in check_points(points) if p.variant in (a, b)]
    common = {p.params for p in points if p.variant == a} & {p.params for p in points if p.variant == b}
    if not common:
        raise ConfigError(f"fit: variants {a!r} and {b!r} have no model size in common")
    fits = fit_variants([p for p in points if p.params in common], budgets, resamples, seed, joint=False,
                        profiles=False)
    return fit_gaps(fits, a, b, budgets)

