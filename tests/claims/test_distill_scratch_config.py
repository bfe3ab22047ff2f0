"""The draft study configs/claims/distill-scratch.yaml holds the design of issue #50: a teacher several
times a student's non-embedding parameters, at 8x the short window, theta 500k, on long documents;
six student variants x three seeds on short data only; >= 20 tokens per parameter everywhere."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ropelab.data.tokenizer import ByteTokenizer, padded_vocab
from ropelab.model import Transformer
from ropelab.study.grid import expand, load_study
from ropelab.study.plan import phase_counts
from ropelab.train.phases import resolve_phases

CONFIG = Path(__file__).parents[2] / "configs/claims/distill-scratch.yaml"


@pytest.fixture(scope="module")
def runs():
    return {run.id: run.config for run in expand(load_study(CONFIG))}


def params(config, non_embedding: bool) -> int:
    model = Transformer(replace(config.model, vocab_size=padded_vocab(ByteTokenizer().vocab_size)))
    return model.num_params(non_embedding=non_embedding)


def test_teacher_knows_long_context_and_outsizes_the_students(runs):
    runs = dict(runs)
    teacher = runs.pop("teacher")
    assert teacher.data.corpus == "shakespeare" and teacher.model.rope.theta == 500_000
    students = list(runs.values())
    short = {phase.config.data.seq_len for s in students for phase in resolve_phases(s)
             if not phase.config.attention.doc_mask}
    assert short == {128} and teacher.data.seq_len >= 8 * 128
    assert params(teacher, True) >= 3 * max(params(s, True) for s in students)
    for config in [teacher, *students]:
        tokens = sum(count.tokens for count in phase_counts(config))
        assert tokens >= 20 * params(config, False)


def test_six_variants_three_seeds_on_short_data_only(runs):
    runs = {name: config for name, config in runs.items() if name != "teacher"}
    assert len(runs) == 18 and {c.seed for c in runs.values()} == {0, 1, 2}
    kd = {name for name, c in runs.items() if c.distill is not None}
    assert kd == {name for name in runs if name.startswith("kd-")} and len(kd) == 9
    assert all(runs[name].distill.teacher == "@teacher" for name in kd)
    tokens = {sum(count.tokens for count in phase_counts(c)) for c in runs.values()}
    assert len(tokens) == 1  # equal tokens
    for config in runs.values():
        short, long = resolve_phases(config)
        d = long.config.data
        assert d.max_doc_len == short.config.data.seq_len and d.piece_order == "apart" and d.positions == "running"
        assert long.config.attention.doc_mask and d.seq_len == 8 * short.config.data.seq_len
    thetas = {tuple(p.config.model.rope.theta for p in resolve_phases(c)) for c in runs.values()}
    assert thetas == {(500_000, 500_000), (10_000, 10_000), (10_000, 500_000)}
