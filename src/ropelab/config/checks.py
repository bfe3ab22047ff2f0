"""Range checks of numeric settings, shared by the `validate` methods of the configs (`ropelab.config`).

Every number a config holds is checked at load, before anything is written:
  * floats are finite and within float32's range (`finite_number`, which `ropelab.config.coerce`
    applies to every float field): the model, optimizer and loss compute in float32 or narrower,
    where a larger magnitude is infinite;
  * integers have an upper bound as well as a lower one: sizes, counts and lengths at most
    `INT_MAX`, so that a product of two (a weight matrix's elements, tokens per batch) stays
    within int64; token counts at most `TOKENS_MAX`; seeds within int64 (`SEED_MAX`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from ropelab.errors import ConfigError

INT_MAX = 2**31 - 1
TOKENS_MAX = 2**53  # exact as a float
SEED_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: smaller positives round towards 0


def finite_number(value: int | float, key: str) -> float:
    """`value` as a float, unless it is nan, infinite or beyond float32's range."""
    if not abs(value) <= FLOAT32_MAX:  # nan compares false
        raise ConfigError(f"{key}={value}: must be a finite number (at most 3.4e38 in magnitude, float32's range)")
    return float(value)


def check_ints(section: str, config: Any, names: Iterable[str], low: int = 1, high: int = INT_MAX) -> None:
    """Each integer setting `section.name` of `config` that is set (not None) in [low, high]."""
    for name in names:
        value = getattr(config, name)
        if value is None or low <= value <= high:
            continue
        rule = ("> 0" if low == 1 else f">= {low}") if value < low else f"<= {high}"
        raise ConfigError(f"{section + '.' if section else ''}{name}={value}: must be {rule}")


def check_float(key: str, value: float, interval: str, why: str = "") -> None:
    """`value` in `interval`, written as in the message: ``"(0, 1]"``, ``"[0, inf)"``. nan is never in it."""
    low_text, high_text = interval[1:-1].split(",")
    low, high = float(low_text), float(high_text)
    above = low < value if interval[0] == "(" else low <= value
    below = value < high if interval[-1] == ")" else value <= high
    if above and below:
        return
    if math.isinf(high):
        rule = f"a finite number {'>' if interval[0] == '(' else '>='} {low_text.strip()}"
    else:
        rule = f"in {interval}"
    raise ConfigError(f"{key}={value}: must be {rule}" + (f" ({why})" if why else ""))
