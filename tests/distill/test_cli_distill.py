"""`ropelab distill` and `ropelab distill --cache`: thin calls, one-line errors before any work."""

from __future__ import annotations

import pytest

from ropelab.cli import main
from ropelab.train.loop import TrainResult


def test_cache_dry_run_prints_the_size_and_writes_nothing(tmp_path, teacher_run, capsys, student_args):
    out = tmp_path / "cache"
    argv = ["distill", "--cache", "--dry-run", "--out", str(out), *student_args, f"distill.teacher={teacher_run}", "distill.top_k=5"]
    assert main(argv) == 0
    assert f"{2 * 2 * 16 * 5 * 6:,} bytes" in capsys.readouterr().out and not out.exists()  # 2 steps of 2 x 16 tokens
    assert main(["distill", "--cache", "--out", str(out), "--dtype", "fp32", *argv[5:]]) == 0
    assert f"wrote {2 * 2 * 16 * 5 * 8:,} bytes" in capsys.readouterr().out and (out / "manifest.json").is_file()


@pytest.mark.parametrize("extra,message", [
    ([], "distill: no distill section"),
    (["distill.teacher=/no/such/teacher"], "no such file or directory"),
    (["distill.teacher=TEACHER", "distill.temperature=0"], "distill.temperature=0.0: must be in [0.01, 100]"),
    (["distill.teacher=TEACHER", "distill.top_k=1000"], "distill.top_k=1000: larger than the vocabulary (259 tokens)"),
    (["distill.logits_cache=/no/cache"], "no manifest.json"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, teacher_run, capsys, extra, message, student_args):
    extra = [e.replace("TEACHER", str(teacher_run)) for e in extra]
    assert main(["distill", "--out", str(tmp_path / "run"), *student_args, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_cache_flags_belong_to_their_mode(teacher_run, capsys, student_args):
    assert main(["distill", "--cache", *student_args, f"distill.teacher={teacher_run}"]) == 2
    assert "--out: required with --cache" in capsys.readouterr().err
    assert main(["distill", "--dry-run", *student_args, f"distill.teacher={teacher_run}"]) == 2
    assert "go with --cache" in capsys.readouterr().err


def test_distill_trains_through_the_train_command(tmp_path, teacher_run, monkeypatch, student_args):
    seen = {}

    def fake_train(config, out_dir):
        seen.update(config=config, out=out_dir)
        return TrainResult(out_dir, 2, 1.0, 1.0, 64, 0.1, 640.0)

    monkeypatch.setattr("ropelab.train.loop.train", fake_train)
    argv = ["distill", "--out", str(tmp_path / "run"), *student_args, f"distill.teacher={teacher_run}", "distill.alpha=0.5"]
    assert main(argv) == 0
    assert seen["out"] == str(tmp_path / "run") and seen["config"].distill.alpha == 0.5
