"""RULER's scoring on hand-made outputs (the values RULER's own `string_match_all` gives), the average
per length and the effective length."""

from __future__ import annotations

import pytest

from ropelab.evaluate.ruler_score import (
    effective_length, effective_length_text, length_averages, postprocess, ruler_summary, share_found,
    string_match_all, summarize_ruler_cell,
)


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
    assert summary == {"score": 75.0, "mrr": pytest.approx((1 + 0.25) / 2), "acc_at_1": 0.5, "mean_rank": 2.5}


def test_average_per_length_is_the_mean_over_tasks():
    tasks = {"a": {"cells": [cell(1024, 100.0, [1]), cell(2048, 50.0, [1])]},
             "b": {"cells": [cell(1024, 80.0, [1]), cell(2048, 20.0, [2])]},
             "c": {"cells": [cell(1024, 0.0, [3]), cell(2048, 0.0, [3])]}}
    assert length_averages(tasks, ["a", "b"]) == {1024: 90.0, 2048: 35.0}
    summary = ruler_summary(tasks, ["a", "b"], 85.6)
    assert summary["average"] == {"1024": 90.0, "2048": 35.0}
    assert summary["effective_length"] == 1024 and summary["effective_length_text"] == "1024"


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
