"""Offline teacher logits: the dry-run size is what gets written, and cached targets give the live loss."""

from __future__ import annotations

import json

import pytest
import torch

from ropelab.config import ConfigError
from ropelab.data.pipeline import build_loaders
from ropelab.distill.cache import CachedTeacher, cache_teacher_logits
from ropelab.train.loss import kd_loss
from ropelab.distill.teacher import load_teacher

CACHE = ["train.grad_accum=2", "distill.top_k=5", "distill.temperature=1.5"]


def _shard_bytes(folder):
    return sum(p.stat().st_size for p in folder.glob("shard_*.bin"))


def test_dry_run_size_equals_bytes_written(tmp_path, teacher_run, student_config, capsys):
    config = student_config(f"distill.teacher={teacher_run}", *CACHE)
    out = tmp_path / "cache"
    size = cache_teacher_logits(config, out, dry_run=True, dtype="fp32")
    assert size == 2 * 2 * (2 * 16 * 5 * (4 + 4))  # steps x micro-steps x (batch x tokens x k x (value + id))
    assert f"{size:,} bytes" in capsys.readouterr().out and not out.exists()
    assert cache_teacher_logits(config, out, dtype="fp32", shard_bytes=700) == size
    assert _shard_bytes(out) == size and len(list(out.glob("shard_*.ids.bin"))) == 4  # one 640-byte batch per shard
    assert cache_teacher_logits(config, tmp_path / "half", dtype="fp16") == _shard_bytes(tmp_path / "half") == size * 6 // 8
    with pytest.raises(ConfigError, match="not empty"):
        cache_teacher_logits(config, out)
    assert _shard_bytes(out) == size  # untouched


@pytest.mark.parametrize("dtype,rel", [("fp32", 1e-6), ("fp16", 2e-3)])
def test_cached_targets_give_the_live_teacher_loss(tmp_path, teacher_run, student_config, dtype, rel):
    config = student_config(f"distill.teacher={teacher_run}", *CACHE)
    cache_teacher_logits(config, tmp_path / "cache", dtype=dtype)
    cached, live = CachedTeacher(tmp_path / "cache", config), load_teacher(config)
    loader = build_loaders(config)[0]
    g = torch.Generator().manual_seed(0)
    head = torch.randn(320, 32, generator=g)
    for step in range(2):
        for micro in range(2):
            batch = loader.batch(step, micro, 2, 2)
            hidden = torch.randn(2, 16, 32, generator=g)
            args = (batch.input_ids, batch.position_ids)
            a = kd_loss(hidden, head, batch.labels, cached.targets(*args), 1.5, 1.0, 5, 7)
            b = kd_loss(hidden, head, batch.labels, live.targets(*args), 1.5, 1.0, 5, 7)
            assert a.kd.item() == pytest.approx(b.kd.item(), rel=rel)
    with pytest.raises(ConfigError, match="holds no teacher logits for this batch"):
        cached.targets(*(lambda b: (b.input_ids, b.position_ids))(loader.batch(7, 0, 2, 2)))


def test_cache_for_other_settings_is_refused_before_work(tmp_path, teacher_run, student_config):
    config = student_config(f"distill.teacher={teacher_run}", *CACHE)
    cache_teacher_logits(config, tmp_path / "cache", dtype="fp16")
    use = lambda *o: student_config(f"distill.teacher={teacher_run}", *CACHE, *o)  # noqa: E731
    with pytest.raises(ConfigError, match="written for temperature=1.5, the run's phase 'train' has 2.0"):
        CachedTeacher(tmp_path / "cache", use("distill.temperature=2"))
    with pytest.raises(ConfigError, match="written for data.seq_len=16"):
        CachedTeacher(tmp_path / "cache", use("data.seq_len=8"))
    with pytest.raises(ConfigError, match="holds 2 steps"):
        CachedTeacher(tmp_path / "cache", use("train.steps=3"))
    with pytest.raises(ConfigError, match="distill.top_k=6: the logits cache holds only the top 5"):
        CachedTeacher(tmp_path / "cache", use("distill.top_k=6"))
    with pytest.raises(ConfigError, match="no manifest.json"):
        CachedTeacher(tmp_path, config)
    assert CachedTeacher(tmp_path / "cache", use("distill.top_k=3", "train.steps=1")).k == 5


def test_cache_covers_every_phase(tmp_path, teacher_run, student_config):
    from ropelab.train.phases import resolve_phases

    phases = ("train.phases=[{name: short, steps: 1, overrides: {data.seq_len: 8}}, "
              "{name: long, steps: 2, overrides: {data.seq_len: 16, attention.doc_mask: true}}]")
    config = student_config(f"distill.teacher={teacher_run}", *CACHE, phases)
    size = cache_teacher_logits(config, tmp_path / "cache", dtype="fp32")
    assert size == _shard_bytes(tmp_path / "cache") == (1 * 2 * 2 * 8 + 2 * 2 * 2 * 16) * 5 * 8
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert [(p["name"], p["steps"]) for p in manifest["phases"]] == [("short", 1), ("long", 2)]
    for phase in resolve_phases(config):
        cached = CachedTeacher(tmp_path / "cache", phase.config)
        batch = build_loaders(phase.config)[0].batch(phase.steps - 1, 1, 2, 2)
        assert cached.targets(batch.input_ids, batch.position_ids).ids.shape == (2, phase.config.data.seq_len, 5)
