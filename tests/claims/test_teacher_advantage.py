"""The teacher's advantage: the decision on made-up measurements (every condition can fail it), the
position ranges, and one end-to-end measurement of two tiny trained runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ropelab.claims.teacher_advantage import (
    ADVANTAGE, INCONCLUSIVE, AdvantageSettings, decide, doubling_edges, loss_keeps_falling, position_ranges,
    teacher_advantage,
)
from ropelab.config import ConfigError, build_run_config
from ropelab.data.prepare import prepare
from ropelab.data.sources import Source
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.evaluate.retrieval import length_result
from ropelab.train.loop import train

SHORT = 128


def made_up(range_losses: list[float], far_correct: int, noise: float = 0.01, windows: int = 6) -> dict:
    """A measurement: per-range losses (each window the mean plus alternating noise) and passkey results
    with `far_correct` of 20 right at 4x and 8x, 2 of 20 at 1x and 2x (chance 0.1)."""
    ranges = [{"start": i, "end": i + 1, "loss": loss,
               "per_window": [loss + noise * (-1) ** (w + i) for w in range(windows)]} for i, loss in enumerate(range_losses)]
    scored = lambda correct: [{"top1": k < correct, "rank": 1.0 if k < correct else 4.0} for k in range(20)]  # noqa: E731
    lengths = [length_result(m, m * SHORT, scored(far_correct if m >= 4 else 2), 0.1) for m in (1, 2, 4, 8)]
    return {"loss_by_position": {"ranges": ranges}, "retrieval": {"chance": 0.1, "lengths": lengths}}


FALLING = [2.0, 1.9, 1.8, 1.7]


def test_advantage_when_all_three_conditions_hold():
    result = decide(made_up(FALLING, far_correct=15), made_up(FALLING, far_correct=2))
    assert result["verdict"] == ADVANTAGE and result["advantage"]
    assert "keeps falling" in result["reasons"][0] and "30/40 = 0.75" in result["reasons"][1]


@pytest.mark.parametrize("teacher, student, why", [
    (made_up([2.0, 1.9, 1.95, 1.7], 15), made_up(FALLING, 2), "a range where the loss rises"),
    (made_up([2.0, 1.999, 1.998, 1.997], 15, noise=0.05), made_up(FALLING, 2), "a fall within the noise"),
    (made_up(FALLING, 3), made_up(FALLING, 2), "teacher retrieval not above chance"),
    (made_up(FALLING, 15), made_up(FALLING, 15), "the student retrieves as well"),
])
def test_inconclusive_when_any_condition_fails(teacher, student, why):
    result = decide(teacher, student)
    assert result["verdict"] == INCONCLUSIVE and not result["advantage"], why


def test_one_window_is_no_evidence_of_a_fall():
    ranges = made_up(FALLING, 15, windows=1)["loss_by_position"]["ranges"]
    assert not loss_keeps_falling(ranges)[0]


def test_position_ranges_double_from_half_the_short_window():
    assert doubling_edges(64, 512) == [32, 64, 128, 256, 512]
    assert doubling_edges(64, 400) == [32, 64, 128, 256, 400]
    losses = np.arange(2 * 512, dtype=float).reshape(2, 512)
    ranges = position_ranges(losses, 64)
    assert [(r["start"], r["end"]) for r in ranges] == [(32, 64), (64, 128), (128, 256), (256, 512)]
    assert ranges[0]["per_window"] == [losses[0, 32:64].mean(), losses[1, 32:64].mean()]
    with pytest.raises(ConfigError, match="short window 512 must be"):
        doubling_edges(512, 512)


@pytest.fixture(scope="module")
def two_tiny_runs(tmp_path_factory, ropelab_cache):
    """A teacher trained at 8x the short window and a student at the short window, a few steps each."""
    root = tmp_path_factory.mktemp("advantage")
    words = "the king is dead long live the king and the queen is here ".split()
    rng = np.random.default_rng(0)
    rows = [{"text": " ".join(rng.choice(words, 500))} for _ in range(40)]
    (root / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    prepare(Source(str(root / "docs.jsonl")), ByteTokenizer(), root / "tokens", val_percent=20, progress=False)
    common = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.n_kv_head=1", "model.d_ff=64",
              "model.max_seq_len=1100", f"data.corpus={root / 'tokens'}", "train.micro_batch=1", "train.steps=2",
              "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=2", "train.progress=false"]
    train(build_run_config(overrides=[*common, f"data.seq_len={8 * SHORT}", "model.rope.theta=500000"]), root / "teacher")
    train(build_run_config(overrides=[*common, f"data.seq_len={SHORT}", "model.rope.theta=10000"]), root / "student")
    return root / "teacher", root / "student"


def test_two_tiny_runs_end_to_end(two_tiny_runs):
    teacher, student = two_tiny_runs
    result = teacher_advantage(str(teacher), str(student), settings=AdvantageSettings(loss_windows=2, items=2))
    assert result["verdict"] in (ADVANTAGE, INCONCLUSIVE) and result["short_window"] == SHORT
    assert result["length"] == 8 * SHORT and result["teacher"]["loss_by_position"]["windows"] == 2
    assert [(r["start"], r["end"]) for r in result["student"]["loss_by_position"]["ranges"]] == [
        (64, 128), (128, 256), (256, 512), (512, 1024)]
    assert [r["length"] for r in result["teacher"]["retrieval"]["lengths"]] == [128, 256, 512, 1024]
    assert result["teacher"]["retrieval"]["items_fingerprint"] == result["student"]["retrieval"]["items_fingerprint"]
    assert "| (512, 1024] |" in result["table"] and "| 1024 (8x) |" in result["table"]
