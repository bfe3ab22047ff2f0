"""`probe weights` on selected-pair plan models: rows are matched by source pair, so a full-RoPE
source and its conversion (weights only permuted) differ by exactly zero, and a change to one pair
of one head shows up in exactly that (head, source pair), flagged kept or dropped."""

import copy
import math

import pytest
import torch

from ropelab.config import ConfigError, ModelConfig, RopeConfig, RopeScalingConfig
from ropelab.probe.channels import LayerRope, layer_rope
from ropelab.probe.weights import weight_changes
from ropelab.sources.plans import apply_plan, resolve_plans, target_config

from probe_helpers import plan_source

# head_dim 8 (4 pairs), 2 KV heads: layer 0 keeps pairs 1, 3 (KV head 0) and 0, 2 (KV head 1); layer 1
# keeps pair 2 and pair 0.
PLAN = [[[1, 3], [0, 2]], [[2], [0]]]


def convert(source, keep=2, select="list", explicit=PLAN):
    plans, config = resolve_plans(target_config(source.config, keep, select, explicit))
    return apply_plan(source, config, plans).eval()


def every_pair(changes, key="per_head_pair"):
    return [(layer["layer"], proj, head, pair, value) for layer in changes["layers"] for proj in ("q", "k")
            for head, row in enumerate(layer[proj][key]) for pair, value in enumerate(row)]


@pytest.mark.parametrize("layout, sources", [
    ("half", [3, 1, 3, 1, 0, 2, 0, 2]),  # channel order (3, 1, 7, 5, 0, 2, 4, 6); pair i is channels i, i+4
    ("interleaved", [3, 3, 1, 1, 0, 0, 2, 2]),  # channel order (6, 7, 2, 3, 0, 1, 4, 5)
])
def test_channels_carry_the_kept_then_the_dropped_source_pairs(layout, sources):
    rope = LayerRope(head_dim=8, rotary_dims=4, layout=layout, theta=100.0, inv_freq=(0.5, 0.25), kept=((3, 1),),
                     spectrum=(1.0, 0.1, 0.01, 0.001))
    assert rope.channel_sources(0).tolist() == sources
    channels = rope.source_pair_channels(0).tolist()
    assert [sorted(sources[c] for c in pair) for pair in channels] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert rope.source_frequencies(0) == (1.0, 0.25, 0.01, 0.5)  # kept: the layer's; dropped: the spectrum's
    assert rope.rotated_mask.tolist() == [True] * 4 + [False] * 4


def test_layer_rope_of_a_scaled_plan_reports_the_scaled_wavelengths():
    scaled = ModelConfig(vocab_size=64, n_layer=1, d_model=32, n_head=4, n_kv_head=2, d_ff=48,
                         rope=RopeConfig(theta=100.0, pairs=[[1, 3], [0, 2]], scaling=RopeScalingConfig("linear", 4.0)))
    plain = copy.deepcopy(scaled)
    plain.rope.scaling = None
    rope, unscaled = layer_rope(scaled, 0), layer_rope(plain, 0)
    assert rope.kept == ((1, 3), (0, 2)) and rope.rotary_dims == 4
    assert [f for heads in rope.inv_freq for f in heads] == pytest.approx([100 ** (-i / 4) / 4 for i in (1, 3, 0, 2)])
    assert rope.wavelengths[1][0] == pytest.approx(4 * unscaled.wavelengths[1][0]) == pytest.approx(8 * math.pi)
    assert rope.source_frequencies(1) == pytest.approx([1 / 4, 100 ** -0.25, 100 ** -0.5 / 4, 100 ** -0.75])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_a_conversion_only_permutes_its_source(layout):
    source = plan_source(layout)
    converted = convert(source)
    for a, b in ((source, converted), (converted, source)):
        changes = weight_changes(a, b, top=5)
        assert {value for *_, value in every_pair(changes)} == {0.0}
        for layer in changes["layers"]:
            assert layer["plan"] == PLAN[layer["layer"]]
            assert layer["q"]["kept_pairs"] == layer["q"]["dropped_pairs"] == layer["k"]["relative_change"] == 0.0
        kept = [(layer, proj, head, pair) for layer, proj, head, pair, flag in every_pair(changes, "kept") if flag]
        assert len(kept) == 2 * 4 + 2 * 2 + 1 * 4 + 1 * 2  # layer 0: 2 of 4 pairs per head; layer 1: 1
        assert (0, "q", 2, 0) in kept and (0, "q", 2, 1) not in kept  # query head 2 is in KV group 1
    assert len(changes["heatmap"]["q"][0]) == 4 + 1  # every source pair, then the dropped ones together


@pytest.mark.parametrize("layout, kept_channels, dropped_channels", [
    ("half", (1, 3), (5, 7)),  # kept pair 2 of KV group 1 is its 2nd kept: (1, 1+2); dropped pair 3 its 2nd dropped
    ("interleaved", (2, 3), (6, 7)),
])
def test_a_change_to_one_pair_shows_in_that_pair(layout, kept_channels, dropped_channels):
    source = plan_source(layout)
    converted = convert(source)
    trained = copy.deepcopy(converted)
    with torch.no_grad():  # layer 0: query head 3 (KV group 1), source pair 2 (kept); key head 1, pair 3 (dropped)
        trained.blocks[0].attn.q_proj.weight[[3 * 8 + c for c in kept_channels]] *= 3.0
        trained.blocks[0].attn.k_proj.weight[[8 + c for c in dropped_channels]] *= 3.0
    changes = weight_changes(source, trained, top=3)
    changed = [(entry, value) for *entry, value in every_pair(changes) if value != 0.0]
    assert [entry for entry, _ in changed] == [[0, "q", 3, 2], [0, "k", 1, 3]]
    assert [value for _, value in changed] == pytest.approx([2.0, 2.0])
    first, second, third = changes["top_spans"]
    assert (first["proj"], first["head"], first["pair"], first["kept"], first["span"]) in {
        ("q", 3, 2, True, "pair 2 (kept)"), ("k", 1, 3, False, "pair 3 (dropped)")}
    spans = {(s["proj"], s["kept"]): s for s in (first, second)}
    assert spans["q", True]["rows_b"] == [3 * 8 + c for c in kept_channels]
    assert spans["k", False]["rows_b"] == [8 + c for c in dropped_channels]
    assert spans["q", True]["wavelength_tokens"] == pytest.approx(2 * math.pi * 100 ** (4 / 8))
    assert third["relative_change"] == 0.0
    layer = changes["layers"][0]
    assert layer["q"]["kept_pairs"] > 0 and layer["q"]["dropped_pairs"] == 0.0
    assert layer["k"]["kept_pairs"] == 0.0 and layer["k"]["dropped_pairs"] > 0
    same_plan = weight_changes(converted, trained)  # two checkpoints of one plan: the same numbers
    assert every_pair(same_plan) == every_pair(changes)


def test_pairs_that_do_not_correspond_are_refused():
    source = plan_source()
    with pytest.raises(ConfigError, match="keeps other pairs"):
        weight_changes(convert(source, 2, "high", None), convert(source, 2, "low", None))
    with pytest.raises(ConfigError, match="rotates 8 channels \\(interleaved\\)"):
        weight_changes(plan_source("interleaved"), convert(source))
    partial = copy.deepcopy(source.config)
    partial.rope = RopeConfig(theta=100.0, fraction=0.5, style="truncate")  # 4 rotated channels, like the plan
    with pytest.raises(ConfigError, match="rotates 4 of its 8 channels without one"):
        weight_changes(type(source)(partial), convert(source))


def test_the_report_shows_each_pairs_rows_in_both_checkpoints():
    from ropelab.probe import plots, report

    source = plan_source()
    trained = convert(source)
    with torch.no_grad():  # layer 1, query head 0 (KV group 0 keeps pair 2): its only kept pair, channels 0 and 1
        trained.blocks[1].attn.q_proj.weight[[0, 1]] *= 2.0
    changes = weight_changes(source, trained, top=1)
    page = report.weights_section(changes, ("src", "conv"), "w.png")
    assert "<td>pair 2 (kept)</td><td>2, 6 → 0, 1</td>" in page  # source pair 2 is channels 2, 2+4 in the source
    assert "<td>1</td><td>8 → 2 (half)</td>" in page
    assert plots.plot_weight_heatmap(changes, "src → conv").startswith(b"\x89PNG")
