"""One-line errors: the offending value is quoted in at most one line of `QUOTE_LIMIT` characters, and a
ConfigError is one line of at most `MESSAGE_LIMIT`, whatever it is built from (issue #52)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.config import ConfigError, build_run_config
from ropelab.errors import MESSAGE_LIMIT, QUOTE_LIMIT, quoted

VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text()),
                      lambda inner: st.one_of(st.lists(inner, max_size=30), st.dictionaries(st.text(), inner, max_size=30)),
                      max_leaves=200)


@settings(max_examples=200, deadline=None)
@given(value=VALUES)
def test_a_quoted_value_is_one_bounded_line(value):
    """Property: any value quotes as one line of at most QUOTE_LIMIT characters, its repr where that fits."""
    text = quoted(value)
    assert len(text.splitlines()) <= 1 and len(text) <= QUOTE_LIMIT
    if len(repr(value)) <= 20 and not isinstance(value, (list, dict)):
        assert text == repr(value)


def test_a_value_shared_a_billion_times_is_quoted_without_building_it():
    """Before: a value of 387 million shared references was printed whole (800 MB) in the error line."""
    value = ["lol"]
    for _ in range(9):
        value = [value] * 9
    assert len(quoted(value)) <= QUOTE_LIMIT


def test_config_errors_quote_a_long_value_short():
    try:
        build_run_config({"model": {"rope": {"style": "x" * 1_000_000}}})
    except ConfigError as exc:
        message = str(exc)
    assert message.startswith("model.rope.style='xxx") and "must be one of 'slice', 'truncate'" in message
    assert len(message) < QUOTE_LIMIT + 100


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=5000))
def test_a_config_error_is_one_bounded_line(text):
    message = str(ConfigError(text))
    assert len(message.splitlines()) <= 1 and len(message) <= MESSAGE_LIMIT
