"""The report section of the scaling-law fits."""

from ropelab.study.fit import Point
from ropelab.study.fit_report import FIGURE_NAME, fit_section
from scaling_points import BUDGETS, PARAMS, points


def test_fit_section_has_tables_a_figure_and_a_held_out_line_per_variant():
    both = points("rope") + points("nope", offset=0.05, noise_seed=1) + [Point("short", 0, PARAMS, 1e5, 3.0)]
    section = fit_section(both, resamples=50)
    assert section.title == "Scaling-law fits" and section.images[FIGURE_NAME].startswith(b"\x89PNG")
    assert "| rope | 1e+05 | 8 | 16 |" in section.markdown
    assert "| nope - rope | 1e+05 | 20 tokens/param |" in section.markdown
    assert section.markdown.count("held-out check") == 2
    assert "not fitted (fewer than 3 budgets): short N=1e+05" in section.markdown
    assert "<table>" in section.html and f"![scaling fit]({FIGURE_NAME})" in section.markdown


def test_fit_section_is_absent_without_three_budgets():
    assert fit_section([p for p in points() if p.tokens >= BUDGETS[-2]]) is None
