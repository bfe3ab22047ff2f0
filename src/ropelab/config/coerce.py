"""Dataclass configs from plain dicts: `from_dict` rejects unknown keys and wrong types with a
`ConfigError` naming the dotted key, and checks every float (`ropelab.config.checks.finite_number`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from ropelab.config.checks import finite_number
from ropelab.errors import ConfigError, quoted


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, str) and str in inner:  # e.g. `dict | str`: a string takes the str branch
            return value
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={quoted(value)}: must be one of {', '.join(repr(a) for a in args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {quoted(value)}")
        return from_dict(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={quoted(value)}: must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={quoted(value)}: must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "4e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={quoted(value)}: must be a number")
        return finite_number(value, key)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={quoted(value)}: must be a string")
        return value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={quoted(value)}: must be a mapping")
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):
            return {name: _coerce(item, args[1], f"{key}.{name}") for name, item in value.items()}
        return value
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={quoted(value)}: must be a list")
        if args:
            return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
        return value
    return value


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)
