"""`ropelab.study.plan`: the one count of a run's steps and tokens, phase by phase (a branch trains only
the steps after its parent's), and the study dry run's row built from it."""

from __future__ import annotations

from ropelab.config import build_run_config
from ropelab.study.grid import PlannedRun
from ropelab.study.plan import phase_counts, run_plan

PHASED = {"data": {"seq_len": 32}, "train": {"micro_batch": 2, "phases": [
    {"name": "short", "steps": 6},
    {"name": "long", "tokens": 1024, "overrides": {"data.seq_len": 64}},  # 1024 / (2 * 64) = 8 steps
]}}


def test_each_phase_counts_its_steps_and_tokens_at_its_own_window():
    counts = phase_counts(build_run_config(PHASED))
    assert [(c.phase.name, c.trained_steps, c.tokens_per_step, c.tokens) for c in counts] == [
        ("short", 6, 64, 384), ("long", 8, 128, 1024)]
    assert [c.trained_tokens for c in counts] == [c.tokens for c in counts]


def test_a_branch_trains_from_its_parent_step_on():
    (count,) = phase_counts(build_run_config({"data": {"seq_len": 64}, "train": {
        "steps": 30, "micro_batch": 2, "branch_from": "trunk", "branch_step": 20}}))
    assert (count.trained_steps, count.trained_tokens, count.tokens) == (10, 1280, 3840)
    phased = build_run_config(PHASED | {"train": {**PHASED["train"], "branch_from": "trunk", "branch_step": 8}})
    assert [c.trained_steps for c in phase_counts(phased)] == [0, 6]  # the branch starts inside the long phase


def test_the_study_plan_counts_every_step_the_model_has_seen():
    config = build_run_config(PHASED | {"train": {**PHASED["train"], "branch_from": "trunk", "branch_step": 8}})
    row = run_plan(PlannedRun("run", {}, config))
    assert (row["steps"], row["tokens"]) == (14, 384 + 1024)
