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
    # ten keys differ; four of them tell the five groups apart, named by the part that is not shared
    assert labels[keys["run0"]] == "layer_kinds.A.attention=full, layer_kinds.B.attention=-, layer_kinds.C.attention=-, layer_kinds.D.attention=-, ..."


def test_a_conversion_plans_layers_are_one_key_and_only_the_keys_that_tell_groups_apart_are_named():
    """A conversion study: a source, its 2-pair plan (30 layers' pairs), two latent ranks, KD and CE."""
    plan = {f"model.rope_layers.{layer}.pairs": [[layer, 3], [1, 2]] for layer in range(30)}
    distill = {"distill.teacher": "src", "distill.top_k": 64, "distill.logits_cache": "/cache/1"}
    def run(steps=0, pairs=False, rank=None, alpha=None):
        return _key(**{"train.steps": steps, **(plan | {"model.rope.keep_pairs": 2} if pairs else {}),
                       **({"model.mla.rank": rank} if rank else {}), **(distill | {"distill.alpha": alpha} if alpha is not None else {})})
    keys = {"full": run(), "pairs2": run(pairs=True), "mla-d8": run(pairs=True, rank=8),
            "kd-d8": run(200, True, 8, 1.0), "ce-d8": run(200, True, 8, 0.0), "kd-d32": run(200, True, 32, 1.0)}
    labels = {name: group_labels(keys)[key] for name, key in keys.items()}
    assert len(set(labels.values())) == len(keys)
    assert all(len(label) < 80 and "rope_layers.0" not in label for label in labels.values()), labels
    assert labels["kd-d8"] == "alpha=1.0, rank=8, keep_pairs=2, ..."
    assert labels["full"] == "alpha=-, rank=-, keep_pairs=-, ..."


def test_a_per_layer_family_is_named_by_its_layer_count_and_a_fingerprint():
    keys = {"a": _key(**{"model.rope_layers.0.pairs": [[1, 2]], "model.rope_layers.1.pairs": [[3, 4]]}),
            "b": _key(**{"model.rope_layers.0.pairs": [[1, 2]], "model.rope_layers.1.pairs": [[5, 6]]})}
    labels = group_labels(keys)
    assert labels[keys["a"]].startswith("pairs=2 layers #") and labels[keys["a"]] != labels[keys["b"]]


def test_a_converted_run_rotates_the_pairs_its_plan_keeps():
    from ropelab.study.run_facts import run_facts

    plan = {"model": {"d_model": 256, "n_head": 4, "rope": {"fraction": 1.0},
                      "rope_layers": {0: {"pairs": [[30, 31], [29, 31]]}, 1: {"pairs": [[31], [30]]}}}}
    facts = run_facts(plan)
    assert (facts["rotary_dims"], facts["head_dim"], facts["fraction_label"]) == (4, 64, "6.25%")
    unresolved = {"model": {"d_model": 256, "n_head": 4, "rope": {"keep_pairs": 1, "select": "high"}}}
    assert run_facts(unresolved)["fraction_label"] == "2 ch"
    assert run_facts({"model": {"d_model": 256, "n_head": 4, "rope": {"fraction": 0.25}}})["rotary_dims"] == 16
