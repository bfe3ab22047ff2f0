"""RULER's scoring: `string_match_all`, its interval, the RULER-11 mean per length and the effective length.

  output           the greedy continuation of the prompt, as RULER post-processes it: stripped, every
                   control character (\\x00-\\x1f) turned into a newline, stripped again;
  string_match_all per item, the share of its references found in the output as substrings, both
                   lowercased (order and repeats ignored); a cell's score is 100 x the mean share,
                   rounded to 2 decimals, exactly RULER's `string_match_all` over the cell's items (RULER
                   scores all 11 synthetic tasks so; its `string_match_part`, any one reference found,
                   is for its two QA tasks, which ropelab does not run);
  interval         every cell carries its item count n and a 95% Wilson score interval of the mean share.
                   For one reference per item the shares are 0 or 1 and this is the usual interval of a
                   proportion; for partial shares (several references) a share in [0, 1] with mean p
                   has a variance of at most p(1 - p), so the same interval is conservative there;
  RULER-11         "RULER-11 (synthetic, no QA)": per length, the mean of the 11 synthetic tasks' cell
                   scores; like the effective length it exists only when all 11 tasks ran (RULER's own
                   average is over 13 tasks, its QA tasks included);
  effective length the longest length whose mean beats (>) the threshold: by default 85.6, Llama-2-7B-chat's
                   mean over RULER's 13 tasks at 4K under its chat template ("[INST] ... [/INST]"), the
                   table in RULER's README ("the maximum length at which the performance exceeds the
                   threshold"). Below every tested length it reads "< shortest"; when the longest tested
                   length passes, "≥ longest" (the paper's "> 128K").
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import numpy as np

from ropelab.evaluate.ruler_tasks import RULER_TASKS

DEFAULT_THRESHOLD = 85.6
RULER_11 = "RULER-11 (synthetic, no QA)"
THRESHOLD_SOURCE = ("85.6 is Llama-2-7B-chat's mean score over RULER's 13 tasks (its 11 synthetic tasks and "
                    "two QA tasks) at 4K tokens under its chat template, [INST] ... [/INST] (RULER's README, "
                    "NVIDIA/RULER); ropelab runs the 11 synthetic tasks with the plain template")
INTERVAL = "95% Wilson score interval of the mean item share (conservative for partial shares)"
_Z = 1.959963984540054  # the standard normal's 97.5% quantile
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(output: str) -> str:
    return _CONTROL.sub("\n", output.strip()).strip()


def share_found(output: str, references: Sequence[str]) -> float:
    """Share of `references` that occur in `output`, case-insensitively."""
    text = output.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_all(outputs: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric over items: 100 x the mean share of each item's references found in its output, 2 decimals."""
    return score_of_shares([share_found(o, r) for o, r in zip(outputs, references)])


def score_of_shares(shares: Sequence[float]) -> float:
    """`string_match_all` of items whose shares of references found are `shares`."""
    return round(100 * sum(shares) / len(shares), 2)


def wilson_interval(mean: float, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a mean share `mean` (in [0, 1]) over `n` items, in [0, 1]."""
    shrink = 1 + _Z**2 / n
    centre = (mean + _Z**2 / (2 * n)) / shrink
    half = _Z / shrink * math.sqrt(mean * (1 - mean) / n + _Z**2 / (4 * n**2))
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize_ruler_cell(results: Sequence[dict]) -> dict:
    """Score (string_match_all) with its item count and 95% interval (both ends in percent, 2 decimals),
    and answer rank (MRR, acc@1, mean rank) of scored items."""
    shares = [share_found(r["output"], r["references"]) for r in results]
    low, high = wilson_interval(float(np.mean(shares)), len(shares))
    return {
        "score": score_of_shares(shares),
        "n": len(results), "interval": [round(100 * low, 2), round(100 * high, 2)],
        "mrr": float(np.mean([1.0 / r["rank"] for r in results])),
        "acc_at_1": float(np.mean([r["top1"] for r in results])),
        "mean_rank": float(np.mean([r["rank"] for r in results])),
    }


def length_averages(tasks: dict[str, dict], names: Sequence[str]) -> dict[int, float]:
    """Mean cell score over the tasks `names` at each length, from `ropelab eval longctx` task results."""
    scores: dict[int, list[float]] = {}
    for name in names:
        for cell in tasks[name]["cells"]:
            scores.setdefault(cell["length"], []).append(cell["score"])
    return {length: float(np.mean(values)) for length, values in scores.items()}


def effective_length(averages: dict[int, float], threshold: float = DEFAULT_THRESHOLD) -> Optional[int]:
    """The longest length whose average is above `threshold`; None when none is."""
    passing = [length for length, average in averages.items() if average > threshold]
    return max(passing) if passing else None


def effective_length_text(averages: dict[int, float], threshold: float = DEFAULT_THRESHOLD) -> str:
    length = effective_length(averages, threshold)
    if length is None:
        return f"< {min(averages)}"
    return f"≥ {length}" if length == max(averages) else str(length)


def ruler_summary(tasks: dict[str, dict], names: Sequence[str], threshold: float) -> dict:
    """A run's RULER tasks, the interval its cells carry, and, only when all 11 tasks ran, the RULER-11
    mean per length with the threshold and the effective length."""
    summary: dict = {"tasks": list(names), "interval": INTERVAL, "complete": set(names) == set(RULER_TASKS)}
    if summary["complete"]:
        averages = length_averages(tasks, names)
        summary |= {"mean_name": RULER_11, "average": {str(k): v for k, v in averages.items()}, "threshold": threshold,
                    "effective_length": effective_length(averages, threshold),
                    "effective_length_text": effective_length_text(averages, threshold)}
    return summary
