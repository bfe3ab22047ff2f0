"""RULER's scoring on cases worked from RULER's own definitions (string_match_all and string_match_part
in its scripts/eval/synthetic/constants.py, the metric of each task in fixtures/ruler/synthetic_tasks.yaml),
the Wilson interval every cell carries, the RULER-11 mean per length and the effective length."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ropelab.evaluate.ruler_items import RULER_TASK_NAMES
from ropelab.evaluate.ruler_score import (
    RULER_11, effective_length, effective_length_text, length_averages, postprocess, ruler_summary, share_found,
    string_match_all, summarize_ruler_cell, wilson_interval,
)

RULER_TABLE = yaml.safe_load((Path(__file__).parent / "fixtures" / "ruler" / "synthetic_tasks.yaml").read_text())


def test_every_task_run_is_scored_by_string_match_all_as_ruler_scores_it():
    metrics = {RULER_TABLE["base_tasks"][RULER_TABLE["tasks"][name]["task"]]["metric"] for name in RULER_TASK_NAMES}
    assert metrics == {"string_match_all"}  # string_match_part is for the QA tasks only


def test_string_match_all_differs_from_string_match_part_where_ruler_s_do():
    # RULER: string_match_part = 100 x mean over items of max over references of (found), so one
    # reference of two found scores 100 there and 50 in string_match_all
    outputs, references = ["the words are apple and pear"], [["apple", "plum"]]
    assert string_match_all(outputs, references) == 50.0
    outputs, references = ["apple", "nothing", "Plum, apple"], [["apple", "plum"], ["x"], ["APPLE", "plum", "fig"]]
    # worked by hand: all = (1/2 + 0 + 2/3) / 3 = 38.89; part would be (1 + 0 + 1) / 3 = 66.67
    assert string_match_all(outputs, references) == 38.89


def test_string_match_all_on_hand_made_outputs():
    outputs = [
        "The special magic numbers are 4567890 and 1234567.",  # both, in the other order
        "ABCDE, fghij",  # case ignored both ways
        "only 1111111 here",  # one of three
        "",  # nothing
    ]
    references = [["1234567", "4567890"], ["abcde", "FGHIJ"], ["1111111", "2222222", "3333333"], ["7654321"]]
    # RULER: sum over items of (found / references), / items, x 100, rounded to 2 decimals
    assert string_match_all(outputs, references) == round((1 + 1 + 1 / 3 + 0) / 4 * 100, 2) == 58.33
    assert string_match_all(outputs[:1], references[:1]) == 100.0
    assert string_match_all(outputs[2:3], references[2:3]) == 33.33


def test_a_reference_counts_once_and_as_a_substring():
    assert share_found("1234567 1234567", ["1234567", "7654321"]) == 0.5  # a repeat finds nothing more
    assert share_found("x12345678y", ["1234567"]) == 1.0  # RULER matches substrings, not words
    assert share_found("VAR ABCDE", ["abcde", "ABCDE"]) == 1.0


def test_output_is_post_processed_as_ruler_does():
    assert postprocess("  1234567\tand\x00 7654321\n\n ") == "1234567\nand\n 7654321"
    assert postprocess("\x1f\x01 answer \x02") == "answer"


def cell(length, score, ranks):
    items = [{"output": "", "references": ["x"], "rank": r, "top1": r == 1.0} for r in ranks]
    return {"length": length, "score": score, "items": items}


def test_cell_summary_scores_and_ranks():
    results = [{"output": "A b", "references": ["a", "c"], "rank": 1.0, "top1": True},
               {"output": "c", "references": ["c"], "rank": 4.0, "top1": False}]
    summary = summarize_ruler_cell(results)
    low, high = wilson_interval(0.75, 2)
    assert summary == {"score": 75.0, "n": 2, "interval": [round(100 * low, 2), round(100 * high, 2)],
                       "mrr": pytest.approx((1 + 0.25) / 2), "acc_at_1": 0.5, "mean_rank": 2.5}


Z2 = 1.959963984540054**2


@pytest.mark.parametrize("mean, n, expected", [
    (0.0, 10, (0.0, Z2 / (10 + Z2))),  # none of n: the upper end is z^2 / (n + z^2)
    (1.0, 1, (1 / (1 + Z2), 1.0)),  # one of one: the lower end is 1 / (1 + z^2)
    (0.5, 10, (0.2366, 0.7634)),  # worked by hand: 0.5 -+ z / (1 + z^2/10) * sqrt(0.025 + z^2 / 400)
])
def test_wilson_interval_on_worked_cases(mean, n, expected):
    assert wilson_interval(mean, n) == pytest.approx(expected, abs=5e-5)


def test_average_per_length_is_the_mean_over_tasks():
    tasks = {"a": {"cells": [cell(1024, 100.0, [1]), cell(2048, 50.0, [1])]},
             "b": {"cells": [cell(1024, 80.0, [1]), cell(2048, 20.0, [2])]},
             "c": {"cells": [cell(1024, 0.0, [3]), cell(2048, 0.0, [3])]}}
    assert length_averages(tasks, ["a", "b"]) == {1024: 90.0, 2048: 35.0}


def test_ruler_11_mean_and_effective_length_only_when_all_eleven_tasks_ran():
    tasks = {name: {"cells": [cell(1024, 100.0 if k < 10 else 0.0, [1]), cell(2048, 50.0, [1])]}
             for k, name in enumerate(RULER_TASK_NAMES)}
    summary = ruler_summary(tasks, RULER_TASK_NAMES, 85.6)
    assert RULER_11 == "RULER-11 (synthetic, no QA)" and summary["mean_name"] == RULER_11 and summary["complete"]
    assert summary["average"] == {"1024": pytest.approx(1000 / 11), "2048": 50.0}
    assert summary["effective_length"] == 1024 and summary["effective_length_text"] == "1024"
    assert "Wilson" in summary["interval"]
    partial = ruler_summary(tasks, RULER_TASK_NAMES[:10], 85.6)
    assert partial == {"tasks": list(RULER_TASK_NAMES[:10]), "interval": summary["interval"], "complete": False}


@pytest.mark.parametrize("averages, threshold, expected, text", [
    ({1024: 96.0, 2048: 90.0, 4096: 86.0, 8192: 40.0}, 85.6, 4096, "4096"),
    ({1024: 96.0, 2048: 85.6, 4096: 70.0}, 85.6, 1024, "1024"),  # equal is not above
    ({1024: 80.0, 2048: 60.0}, 85.6, None, "< 1024"),  # RULER's "< 4K"
    ({1024: 99.0, 2048: 98.0}, 85.6, 2048, "≥ 2048"),  # RULER's "> 128K": past every tested length
    ({1024: 50.0, 2048: 90.0, 4096: 10.0}, 85.6, 2048, "2048"),  # the longest length above, as the paper defines it
    ({1024: 60.0, 2048: 55.0}, 50.0, 2048, "≥ 2048"),  # a threshold of one's own
    ({1024: 0.0}, 0.0, None, "< 1024"),
])
def test_effective_length_is_the_longest_length_above_the_threshold(averages, threshold, expected, text):
    assert effective_length(averages, threshold) == expected
    assert effective_length_text(averages, threshold) == text


def test_default_threshold_is_llama2_7b_at_4k():
    assert effective_length({4096: 85.7}) == 4096 and effective_length({4096: 85.6}) is None
