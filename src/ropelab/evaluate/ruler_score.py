"""RULER's scoring: `string_match_all`, the average per length and the effective length.

  output           the greedy continuation of the prompt, as RULER post-processes it: stripped, every
                   control character (\\x00-\\x1f) turned into a newline, stripped again;
  string_match_all per item, the share of its references found in the output as substrings, both
                   lowercased (order and repeats ignored); a cell's score is 100 x the mean share,
                   rounded to 2 decimals, exactly RULER's `string_match_all` over the cell's items;
  average          per length, the mean of the RULER tasks' cell scores;
  effective length the longest length whose average beats (>) the threshold: by default 85.6, the
                   score of Llama-2-7B at 4K in the RULER paper ("the maximum length at which the
                   performance exceeds the threshold"). Below every tested length it reads "< shortest";
                   when the longest tested length passes, "≥ longest" (the paper's "> 128K").
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np

DEFAULT_THRESHOLD = 85.6
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(output: str) -> str:
    return _CONTROL.sub("\n", output.strip()).strip()


def share_found(output: str, references: Sequence[str]) -> float:
    """Share of `references` that occur in `output`, case-insensitively."""
    text = output.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_all(outputs: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric over items: 100 x the mean share of each item's references found in its output, 2 decimals."""
    return round(100 * sum(share_found(o, r) for o, r in zip(outputs, references)) / len(outputs), 2)


def summarize_ruler_cell(results: Sequence[dict]) -> dict:
    """Score (string_match_all) and answer rank (MRR, acc@1, mean rank) of scored items."""
    return {
        "score": string_match_all([r["output"] for r in results], [r["references"] for r in results]),
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
    """The averages per length, the threshold and the effective length of a run's RULER tasks."""
    averages = length_averages(tasks, names)
    return {"tasks": list(names), "average": {str(k): v for k, v in averages.items()}, "threshold": threshold,
            "effective_length": effective_length(averages, threshold),
            "effective_length_text": effective_length_text(averages, threshold)}
