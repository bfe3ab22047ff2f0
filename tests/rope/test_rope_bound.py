"""The RoPE base lower bound of Men et al. 2024 against a brute-force reading of its definition."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ropelab.cli import main
from ropelab.config import ConfigError
from ropelab.rope import inverse_frequencies
from ropelab.rope.bound import base_lower_bound, bound_table, discrimination, discrimination_upto, first_negative


def brute_B(m: int, base: float, d: int) -> float:
    return sum(math.cos(m * base ** (-2 * i / d)) for i in range(d // 2))


def brute_passes(base: float, d: int, context: int) -> bool:
    return min(brute_B(m, base, d) for m in range(context + 1)) >= -1e-12  # float rounding


@pytest.mark.parametrize("d, context", [(4, 30), (8, 60), (16, 300), (32, 1000), (64, 2048), (128, 1024)])
def test_bound_passes_and_just_below_fails_by_brute_force(d, context):
    bound = base_lower_bound(context, d)
    assert brute_passes(bound, d, context)
    assert not brute_passes(bound * (1 - 1e-4), d, context)


@settings(max_examples=12, deadline=None)
@given(d=st.sampled_from([4, 8, 16, 32]), short=st.integers(2, 600), extra=st.integers(0, 600))
def test_bound_is_monotone_in_the_context(d, short, extra):
    assert base_lower_bound(short, d) <= base_lower_bound(short + extra, d) * (1 + 1e-9)  # the bound's precision


def test_passing_bases_are_not_an_interval():
    # A bisection would assume they are: here a base 5% above the bound fails again (an "island").
    bound = base_lower_bound(1024, 128)
    assert first_negative(bound, 128, 1024) is None
    assert first_negative(bound * 1.05, 128, 1024) is not None


@pytest.mark.parametrize("base", [10.0, 1e4, 5e5, 1e9])
@pytest.mark.parametrize("d", [2, 16, 64])
def test_discrimination_uses_ropes_frequencies(base, d):
    m = np.arange(0, 50_001, 7)
    freqs = inverse_frequencies(d, d, base, "slice").numpy()
    expected = np.cos(np.multiply.outer(m, freqs)).sum(-1)
    np.testing.assert_allclose(discrimination(m, base, d), expected, atol=1e-9)
    np.testing.assert_allclose(discrimination_upto(base, d, 50_000)[m], expected, atol=1e-9)


def test_two_rotary_dims_have_no_bound_and_odd_dims_are_refused():
    assert base_lower_bound(100, 2) == math.inf  # B(m) = cos(m) whatever the base
    with pytest.raises(ConfigError, match="rotary_dims=3"):
        base_lower_bound(100, 3)


def test_table_checks_each_theta_where_it_first_fails():
    (row,) = bound_table([1024], [64], thetas=[1e3, 1e7])
    assert row["base_lower_bound"] == base_lower_bound(1024, 64)
    first = row["first_negative"]
    assert first[1e7] is None and first[1e3] == first_negative(1e3, 64, 1024) < 1024
    assert brute_B(first[1e3], 1e3, 64) < 0 and all(brute_B(m, 1e3, 64) >= 0 for m in range(first[1e3]))


def test_cli_json_and_tables(capsys):
    assert main(["rope-base", "--context", "512,1k", "--dims", "16,32", "--theta", "10000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["rotary_dims"], r["context"]) for r in rows] == [(16, 512), (16, 1024), (32, 512), (32, 1024)]
    assert rows[3]["base_lower_bound"] == pytest.approx(base_lower_bound(1024, 32))
    assert main(["rope-base", "--context", "1k", "--dims", "64", "--no-progress"]) == 0
    assert "7.75e+03" in capsys.readouterr().out
    assert main(["rope-base", "--dims", "5"]) == 2
