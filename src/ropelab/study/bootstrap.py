"""Bootstrap intervals for a study's fits: 95 % percentile intervals over the seeds and the points of
each seed (`Resampler`), so that an interval holds the seed-to-seed noise as well as the noise of each
run's curve. The same seed gives the same resamples, and so the same intervals.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ropelab.config import ConfigError
from ropelab.study.fit import MIN_BUDGETS, Point, check_points

__all__ = ["DEFAULT_RESAMPLES", "MIN_SEEDS", "Estimate", "Resampler", "bootstrap", "group_by", "random_stream"]

DEFAULT_RESAMPLES = 400
MIN_SEEDS = 2  # an interval over one seed holds none of the seed-to-seed noise (and can have zero width)


@dataclass(frozen=True)
class Estimate:
    """A fitted value and its 95 % bootstrap percentile interval over the points of `seeds` seeds; the
    interval is shown only from `MIN_SEEDS` seeds up."""
    value: float
    low: float
    high: float
    seeds: int

    @classmethod
    def from_samples(cls, value: float, samples: np.ndarray, seeds: int) -> Estimate:
        """`value` with the 2.5th and 97.5th percentiles of its bootstrap `samples`."""
        low, high = np.percentile(samples, [2.5, 97.5])
        return cls(float(value), float(low), float(high), seeds)

    @property
    def has_interval(self) -> bool:
        return self.seeds >= MIN_SEEDS

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high

    def __str__(self) -> str:
        interval = f"{self.low:.4g}, {self.high:.4g}" if self.has_interval else "n/a (one seed)"
        return f"{self.value:.4g} [{interval}]"


def group_by(items, key: Callable) -> dict:
    """`items` in lists by `key(item)`, the keys and each list in order of first appearance."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def random_stream(seed: int, *key) -> np.random.Generator:
    """A random stream of its own for each `key` (any values, by their str), reproducible from `seed`."""
    return np.random.default_rng([seed, zlib.crc32(repr(tuple(map(str, key))).encode())])


class Resampler:
    """Resamples as multiplicities (resamples x points): seeds drawn with replacement, then within each
    (variant, size) the points of each drawn seed with replacement. Variants with the same seed labels
    share the seed draws: runs of the same seed see the same data order, so their noise is paired.
    Points without a seed label form one seed. The seed draws come from a random stream per set of
    labels, the point draws from one per (variant, size): a size's resamples are the same whatever
    other sizes and variants are resampled with it."""

    def __init__(self, points: list[Point], seed: int, salt: str = ""):
        self.n, self.labels, self.groups = len(points), {}, []
        for variant, members in group_by(range(len(points)), lambda i: points[i].variant).items():
            labels = tuple(sorted({points[i].seed for i in members}, key=str))
            self.labels.setdefault(labels, random_stream(seed, salt, *labels))
            for params, group in group_by(members, lambda i: points[i].params).items():
                strata = [[i for i in group if points[i].seed == label] for label in labels]
                table = np.zeros((len(labels), max(map(len, strata))), int)  # the points of each seed
                for row, stratum in zip(table, strata):
                    row[:len(stratum)] = stratum
                budgets = np.unique([points[i].tokens for i in group], return_inverse=True)[1]
                self.groups.append((labels, table, np.array([len(s) for s in strata]), budgets, group,
                                    random_stream(seed, salt, variant, params)))

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


def bootstrap(points: Sequence[Point], statistic: Callable[[list[Point]], Mapping[str, float]],
              resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Estimate]:
    """Each value of ``statistic(points)`` with its 95 % percentile interval over `resamples` resamples
    (see `Resampler`: over seeds, then over the points of each seed) drawn from `seed`, so the same
    call gives the same intervals. Resamples on which the statistic raises ConfigError (e.g. a fit left
    fewer than 3 budgets) are drawn again. `ropelab.study.variant_fits.fit_variants` and
    `ropelab.study.fit_checks.held_out_checks` refit their resamples once for all their statistics
    instead."""
    points = check_points(points)
    values, resampler, samples, redrawn = statistic(points), Resampler(points, seed), [], 0
    while len(samples) < resamples:
        for row in resampler.draw(resamples - len(samples), need_budgets=False):
            try:
                samples.append(statistic([p for p, n in zip(points, row) for _ in range(n)]))
            except ConfigError:
                redrawn += 1
                if redrawn > resamples:
                    raise ConfigError(f"fit: {redrawn} bootstrap resamples had too few budgets to fit; "
                                      "measure more budgets or seeds") from None
    seeds = len({p.seed for p in points})
    return {key: Estimate.from_samples(value, np.array([s[key] for s in samples]), seeds) for key, value in values.items()}
