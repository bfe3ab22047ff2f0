"""Comparison groups' names: the config values that tell groups apart, readable and never shared by
two groups."""

from __future__ import annotations

import json

from ropelab.study.run_facts import group_labels


def _key(**flat) -> str:
    return json.dumps(flat, sort_keys=True)


def test_one_group_is_all_and_the_layer_pattern_comes_first():
    assert group_labels({"a": _key(x=1), "b": _key(x=1)}) == {_key(x=1): "all"}
    keys = {"a": _key(**{"model.layer_pattern": "RRRN", "data.seq_len": 256}),
            "b": _key(**{"model.layer_pattern": None, "data.seq_len": 512})}
    assert group_labels(keys) == {keys["a"]: "layer_pattern=RRRN, seq_len=256", keys["b"]: "layer_pattern=None, seq_len=512"}


def test_groups_differing_beyond_four_keys_or_in_keys_with_one_last_part_get_distinct_names():
    """Layouts differ in many nested keys of one name (each layer kind's `attention`, `rope`)."""
    kinds = [{f"model.layer_kinds.{k}.attention": "full", f"model.layer_kinds.{k}.rope": "none"} for k in "ABCDE"]
    keys = {f"run{i}": _key(**{**kinds[i], "model.layer_kinds.Z.window": 64}) for i in range(5)}
    labels = group_labels(keys)
    assert len(set(labels.values())) == 5
    assert "layer_kinds.A.attention=full" in labels[keys["run0"]] and "layer_kinds.E.rope=-" in labels[keys["run0"]]
