"""A claim of a seed, the studies that test it, and what the test found.

A `Claim` names the shipped study configs it needs (stems under ``configs/claims/``) and a
`judge` that reads their finished study folders and returns a `Finding`: what was measured, the
figure, a small table and the verdict. A judge may run post-training evaluations (lm-eval, the
probe); it caches them inside the study folder so that a re-run of `ropelab claims` repeats nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

from ropelab.claims.verdict import Verdict, all_hold

Parts = list[tuple[str, Verdict]]  # (the part of a claim, its verdict)


@dataclass(frozen=True)
class Finding:
    measured: str  # what was measured at tiny scale, with the figures that decided the verdict
    verdict: Verdict
    figure: Optional[bytes] = None  # PNG
    figure_caption: str = ""
    table: Optional[tuple[list[str], list[list[str]]]] = None  # (header, rows), cells already formatted
    note: str = ""  # caveats: what the tiny scale cannot test and what stands in for it
    regime: str = ""  # the training regime the verdict comes from, e.g. "2.5-20 tokens per non-embedding parameter"


@dataclass(frozen=True)
class Claim:
    id: str  # short and stable: "rq1", "kd-beats-ce"
    seed: str  # "partial-rope (000)" or "short-data-long-context (001)"
    section: str  # where the seed makes it, e.g. "Sec. 4, RQ1"
    statement: str  # the seed's claim in our words
    studies: tuple[str, ...]  # config stems under configs/claims/
    judge: Callable[[Mapping[str, Path]], Finding] = field(repr=False)  # {study stem: study folder} -> Finding
    seed_regime: str = ""  # the regime of the seed's own runs, beside the finding's
    decides: bool = True  # False: a second, labelled setting, chosen by its id only (not by its seed's number)

    @property
    def seed_number(self) -> str:
        """The seed's number from its label: "000" for "partial-rope (000)"."""
        return self.seed.rsplit("(", 1)[1].rstrip(")")


def from_parts(measured: str, parts: Parts, figure: bytes, caption: str, note: str = "", regime: str = "") -> Finding:
    """A finding whose verdict needs every part of the claim to hold, with the parts as its table."""
    table = (["part of the claim", "verdict", "decided by"], [[name, v.outcome, v.reason] for name, v in parts])
    return Finding(measured=measured, verdict=all_hold([v for _, v in parts]), figure=figure, figure_caption=caption,
                   table=table, note=note, regime=regime)
