"""The report section of the scaling-law fits."""

import re

from ropelab.study.fit import Point
from ropelab.study.fit_report import FIGURE_NAME, MAX_EXTRAPOLATION, PROFILE_FIGURE_NAME, fit_section
from scaling_points import BUDGETS, PARAMS, joint_law, points


def test_fit_section_has_tables_a_figure_and_a_held_out_line_per_variant():
    both = points("rope") + points("nope", offset=0.05, noise_seed=1) + [Point("short", 0, PARAMS, 1e5, 3.0)]
    section = fit_section(both, resamples=50)
    assert section.title == "Scaling-law fits" and section.images[FIGURE_NAME].startswith(b"\x89PNG")
    assert "| rope | 1e+05 | 8 | 16 |" in section.markdown
    assert "| nope - rope | 1e+05 | 20 tokens/param |" in section.markdown
    assert section.markdown.count("held-out check") == 2
    assert "not fitted (fewer than 3 budgets): short N=1e+05" in section.markdown
    assert "<table>" in section.html and f"![scaling fit]({FIGURE_NAME})" in section.markdown


def test_fit_section_shows_the_profiles_and_says_which_parameters_are_identified():
    """Three sizes from the joint law: its alpha and beta are identified; a flat law's alpha is not."""
    sizes = (1e5, 1e6, 1e7)
    flat = points("flat", sizes=sizes, law=lambda n, d: joint_law(1e12, d), noise_seed=2)
    section = fit_section(points(sizes=sizes, law=joint_law, noise_seed=1) + flat, resamples=20)
    assert section.images[PROFILE_FIGURE_NAME].startswith(b"\x89PNG")
    assert f"![profiles]({PROFILE_FIGURE_NAME})" in section.markdown
    assert "| variant | law | parameter | best fit | profile interval | identified? |" in section.markdown
    alpha_rows = {line.split(" | ")[0].strip("| "): line for line in section.markdown.splitlines()
                  if line.startswith("| ") and "| L(N, D) | alpha |" in line}
    assert alpha_rows["rope"].endswith("| yes |") and alpha_rows["flat"].endswith("| no |")
    assert "alpha in the joint law of 1 of 2 variants (rope)" in section.markdown
    assert "identified?" in section.html


def test_fit_section_without_three_budgets_says_why():
    section = fit_section([p for p in points() if p.tokens >= BUDGETS[-2]])
    assert section.markdown == ("No fit: a scaling-law fit needs at least 3 token budgets per variant and model size, "
                                "and this study has at most 2.") and not section.images


def test_one_seed_gives_no_interval_and_no_held_out_verdict():
    """With one seed an interval holds no seed-to-seed noise; the held-out check's fit to three budgets
    goes through its points, and its interval has zero width."""
    one_seed = [p for p in points(seeds=(0,)) if p.tokens in BUDGETS[::2]]
    section = fit_section(one_seed, resamples=50)
    row = next(line for line in section.markdown.splitlines() if line.startswith("| rope |"))
    assert row.count("[n/a (one seed)]") == 3 and not re.search(r"\[([^,\]]+), \1\]", section.markdown)
    assert "intervals need at least 2 seeds" in section.markdown and "intervals need at least 2 seeds" in section.html
    assert "not judged (intervals need at least 2 seeds)" in section.markdown and "OUTSIDE" not in section.markdown


def test_a_loss_predicted_outside_the_measured_budgets_says_how_far():
    """BUDGETS run from 1 to 100 tokens per parameter: 200 is 2x past the largest, 0.5 is 2x short of the
    smallest, 20,000 (200x) is past the limit of what is shown."""
    budgets = {"20 tokens/param": 20.0, "200 tokens/param": 200.0, "0.5 tokens/param": 0.5,
               "20000 tokens/param": 20_000.0}
    section = fit_section(points() + points("nope", offset=0.05, noise_seed=1), budgets, resamples=50)
    rows = [line.split(" | ") for line in section.markdown.splitlines()
            if line.startswith(("| rope |", "| nope - rope |")) and "| L(D) at" not in line]  # not the profiles' rows
    (fit_row, *gap_rows) = rows
    inside, past, short, far = fit_row[-4:]
    assert "n/a" not in inside and "measured" not in inside and re.fullmatch(r"\S+ \[\S+, \S+\]", inside)
    assert past.endswith("] (2x past the largest budget measured)")
    assert short.endswith("] (2x short of the smallest budget measured)")
    refused = f"n/a (200x past the largest budget measured; shown up to {MAX_EXTRAPOLATION:g}x)"
    assert far == refused + " |"
    assert [row[-1] for row in gap_rows][-1] == refused + " |" and len(gap_rows) == 4
    # in the HTML too: rope's and nope's rows and their gap's
    assert section.html.count(refused) == 3 and "(2x short of the smallest budget measured)" in section.html
