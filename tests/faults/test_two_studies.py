"""Two processes on one study folder (issue #52): a second `ropelab study` on a live study's --out, and a
trainer of another process taking one of the study's runs after the study has looked at it. Nothing of
the other process is deleted, and no stale `failed` status or `error.txt` is left in its run."""

import os
import signal
import subprocess
import time

import yaml

from ropelab.cli import main
from ropelab.study import runner
from ropelab.study.grid import StudyConfig
from ropelab.study.runner import run_study
from ropelab.train.lock import RunLock, is_locked
from ropelab.train.metrics import read_metrics
from ropelab.train.stop import EX_TEMPFAIL

from .helpers import ropelab_cmd, worker_env

BASE = {
    "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 1, "d_ff": 64},
    "data": {"tokenizer": "bytes", "seq_len": 16},
    "train": {"steps": 4, "micro_batch": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2},
}
TWO_RUNS = [{"name": "a"}, {"name": "b", "seed": 1}]
# what a trainer writes in its run before its first checkpoint
STARTED = {"config.yaml": "seed: 1\n", "metrics.jsonl": '{"step": 1, "loss": 5.5}\n'}


def started_elsewhere(run):
    """Another process's trainer in `run`: its lock held (released by the caller), its first files written."""
    lock = RunLock(run).acquire()
    for name, text in STARTED.items():
        (run / name).write_text(text)
    return lock


def test_a_run_another_process_starts_after_the_study_looked_is_left_alone(tmp_path, monkeypatch, capsys):
    out, taken = tmp_path / "study", []
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "base": BASE, "variants": TWO_RUNS}))
    decided = runner.decide  # the engine's layouts: chosen right after the study has read every run's status

    def then_another_trainer_starts(*args, **kwargs):
        layouts = decided(*args, **kwargs)
        taken.append(started_elsewhere(out / "runs" / "b"))
        return layouts

    monkeypatch.setattr(runner, "decide", then_another_trainer_starts)
    try:
        assert main(["study", "--config", str(config), "--out", str(out), "--no-live", "--jobs", "1"]) == EX_TEMPFAIL
    finally:
        taken[0].release()
    printed = capsys.readouterr().out
    assert "study done: 1/2 runs finished" in printed
    assert "runs another process is training, left alone (re-run the same command once it is done): b" in printed
    run = out / "runs" / "b"
    assert {name: (run / name).read_text() for name in STARTED} == STARTED  # before: both deleted
    assert not (run / "error.txt").exists() and not (run / "train.log").exists()


def test_a_run_taken_between_the_study_and_its_trainer_is_not_marked_failed(tmp_path, monkeypatch):
    out, taken = tmp_path / "study", []
    popen = subprocess.Popen

    def another_trainer_first(command, **kwargs):
        run = out / "runs" / "b"
        if command[command.index("--out") + 1] == str(run):
            taken.append(started_elsewhere(run))
        return popen(command, **kwargs)

    monkeypatch.setattr(runner.subprocess, "Popen", another_trainer_first)
    try:  # eager: its trainers are the processes this test steps in front of (auto's come from a warm server)
        assert run_study(StudyConfig(name="t", base=BASE, variants=TWO_RUNS), out, live=False, engine="eager") == {
            "a": "done", "b": "elsewhere"}
    finally:
        for lock in taken:
            lock.release()
    run = out / "runs" / "b"
    assert {name: (run / name).read_text() for name in STARTED} == STARTED
    assert not (run / "error.txt").exists()  # before: "failed", and error.txt holding the trainer's refusal


def test_a_second_study_on_a_live_study_stops_in_one_line(tmp_path):
    long_base = {**BASE, "train": {**BASE["train"], "steps": 1500, "eval_every": 1500, "checkpoint_every": 1500}}
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "base": long_base, "variants": TWO_RUNS}))
    out = tmp_path / "s"
    command = ropelab_cmd("study", "--config", config, "--out", out, "--no-live", "--jobs", 1, "--engine", "eager")
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=worker_env())
    try:
        deadline = time.time() + 120
        while not read_metrics(out / "runs" / "a"):  # its trainer is past its first step
            assert first.poll() is None and time.time() < deadline, first.communicate()[1].decode()[-2000:]
            time.sleep(0.05)
        second = subprocess.run(command, capture_output=True, text=True, env=worker_env(), timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.splitlines() == [second.stderr.strip()], second.stderr[-2000:]
        assert second.stderr.startswith(f"ropelab: error: {out}: another study is running in it (pid {first.pid} on ")
        assert (out / "runs" / "a" / "config.yaml").is_file() and not (out / "runs" / "a" / "error.txt").exists()
        assert not (out / "runs" / "b").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == EX_TEMPFAIL
    assert not is_locked(out) and not is_locked(out / "runs" / "a")
    assert os.path.isfile(out / "runs" / "a" / "config.yaml")


def test_a_second_claims_run_on_a_live_one_stops_in_one_line(tmp_path, capsys):
    out = tmp_path / "claims"
    with RunLock(out / "partial-pythia", role="study"):  # the first `ropelab claims` training that study
        code = main(["claims", "--only", "rq4", "--out", str(out), "--no-live"])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [err.strip()]
    assert err.startswith(f"ropelab: error: {out / 'partial-pythia'}: another study is running in it (pid {os.getpid()} on ")
    assert sorted(os.listdir(out / "partial-pythia")) == [".lock"]  # no study.yaml, no run
