"""Every numeric setting of a run config, driven through edge values (nan, infinities, negatives, zero,
tiny and huge numbers): the config is refused at load in one line naming the key, or it is accepted
and a run trains on it with finite losses."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import types
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ropelab.distill  # noqa: F401 - registers the KD objective
from ropelab.config import SCALING_METHODS, ConfigError, RunConfig, build_run_config, parse_override, set_dotted
from ropelab.train.loop import train

FLOAT_EDGES = (math.nan, math.inf, -math.inf, -1e300, -1.0, 0.0, 1e-300, 1e-40, 1e-12, 0.5, 1.0, 2.0, 1e12,
               3.4e38, 3.5e38, 1e300)
INT_EDGES = (-2**62, -1, 0, 1, 2, 3, 64, 2**31, 2**53 + 1, 2**62, 2**64)

TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.n_kv_head=1", "model.d_ff=32",
        "model.max_seq_len=64", "data.tokenizer=bytes", "data.seq_len=16", "train.micro_batch=2", "train.steps=2",
        "train.eval_every=1", "train.eval_batches=1", "train.checkpoint_every=1", "train.progress=false",
        "train.tensorboard=false"]
PHASES = "train.phases=[{name: a, steps: 1}, {name: b, steps: 1}]"
SCALING = {  # head_dim 8: 4 rotated pairs
    "linear": "{method: linear, factor: 2}",
    "ntk": "{method: ntk, factor: 2}",
    "dynamic": "{method: dynamic, factor: 2, original_max_position: 8}",
    "yarn": "{method: yarn, factor: 2, original_max_position: 8}",
    "llama3": "{method: llama3, factor: 2, original_max_position: 8}",
    "longrope": "{method: longrope, factor: 2, original_max_position: 8, short_factor: [1, 1, 1, 1], "
                "long_factor: [2, 2, 2, 2]}",
}
# settings a field needs beside it to mean anything
COMPANIONS = {
    "model.rope.keep_pairs": ["model.rope.select=high"],
    "train.phases[0].steps": [PHASES],
    "train.phases[0].tokens": ["train.phases=[{name: a, tokens: 32}, {name: b, steps: 1}]"],
}


def numeric_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int | float | list) of every numeric setting under `cls`: through nested and optional
    sections, and lists of sections (the first item stands for all); a list of numbers as `list`."""
    found = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(arg for arg in typing.get_args(tp) if arg is not type(None))
        args = typing.get_args(tp)
        key = prefix + field.name
        if dataclasses.is_dataclass(tp):
            found += numeric_fields(tp, key + ".")
        elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            found += numeric_fields(args[0], key + "[0].")
        elif tp in (int, float):
            found.append((key, tp))
        elif typing.get_origin(tp) is list and args in ((int,), (float,)):
            found.append((key, list))
    return found


FIELDS = numeric_fields()
GROUPS = ("model.rope.scaling.", "model.rope.", "model.", "data.", "train.phases[0].", "train.", "distill.", "seed")


def group_of(key: str) -> str:
    return next(group for group in GROUPS if key.startswith(group))


def companions(key: str, method: str, teacher: str) -> list[str]:
    extra = list(COMPANIONS.get(key, []))
    if key.startswith("model.rope.scaling."):
        extra.append(f"model.rope.scaling={SCALING[method]}")
    if key.startswith("distill."):
        extra.append(f"distill.teacher={teacher}")
    return extra


def config_tree(key: str, value, extra: list[str]) -> dict:
    tree: dict = {}
    for text in [*TINY, *extra]:
        set_dotted(tree, *parse_override(text))
    set_dotted(tree, key, value)
    return tree


def build_or_refuse(key: str, value, extra: list[str]):
    """The config, or None when it is refused in one line naming `key` (any other outcome fails)."""
    try:
        return build_run_config(config_tree(key, value, extra))
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and key.split(".")[-1] in message, message
        return None


class _Enough(Exception):
    pass


def _stop_after_two_steps(row: dict) -> None:
    if row["step"] >= 2:
        raise _Enough


def trains(config: RunConfig, run_dir: Path) -> None:
    """Two steps (or the run's one) with finite losses, or a one-line refusal before config.yaml is written."""
    rows = []
    try:
        train(config, run_dir, callbacks=(rows.append, _stop_after_two_steps))
    except _Enough:
        pass
    except ConfigError as exc:
        assert "\n" not in str(exc) and not (run_dir / "config.yaml").exists()
        return
    assert rows and all(math.isfinite(row["loss"]) for row in rows), rows


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("teacher") / "run"
    train(build_run_config(overrides=[*TINY, "train.steps=1"]), run_dir)
    return str(run_dir)


def test_every_section_is_enumerated():
    keys = {key for key, _ in FIELDS}
    assert {"seed", "model.init_std", "model.rope.theta", "model.rope.scaling.mscale", "data.val_percent",
            "train.lr", "train.phases[0].tokens", "train.checkpoint_steps", "distill.temperature"} <= keys
    assert len(keys) == len(FIELDS) and all(group_of(key) for key in keys)


@pytest.mark.parametrize("key, kind", FIELDS, ids=[key for key, _ in FIELDS])
def test_edge_values_are_accepted_or_refused_in_one_line(key, kind):
    edges = FLOAT_EDGES if kind is float else INT_EDGES
    methods = SCALING_METHODS if key.startswith("model.rope.scaling.") else ("linear",)
    for method in methods:
        for value in edges:
            build_or_refuse(key, [value] if kind is list else value, companions(key, method, "teacher"))


def _value(kind: type) -> st.SearchStrategy:
    if kind is float:
        return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats())
    ints = st.one_of(st.sampled_from(INT_EDGES), st.integers(-3, 40))
    return st.lists(ints, min_size=1, max_size=1) if kind is list else ints


@pytest.mark.parametrize("group", GROUPS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_accepted_values_train(group, data, teacher):
    key, kind = data.draw(st.sampled_from([(k, t) for k, t in FIELDS if group_of(k) == group]), label="field")
    value = data.draw(_value(kind), label="value")
    method = data.draw(st.sampled_from(SCALING_METHODS), label="method") if group == "model.rope.scaling." else ""
    config = build_or_refuse(key, value, companions(key, method, teacher))
    if config is not None:
        with tempfile.TemporaryDirectory() as folder:
            trains(config, Path(folder) / "run")
