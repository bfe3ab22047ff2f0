"""The warm-start server: a trainer forked from it writes what a fresh process writes, stops on SIGTERM
with a checkpoint, exits with the codes a fresh process exits with, and a study goes on without it."""

import json
import os
import signal
import subprocess
import time

import pytest

from ropelab.study.warm_start import LOST, LOST_NOTE, WarmStarter, WarmTrainer, plain_start
from ropelab.train.checkpoint import latest_checkpoint
from ropelab.train.metrics import read_metrics
from ropelab.train.stop import EX_TEMPFAIL

TINY = ["--preset", "tiny-llama", "--no-progress", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.n_kv_head=1", "model.d_ff=64", "data.tokenizer=bytes", "data.seq_len=16", "train.micro_batch=2",
        "train.precision=fp32", "train.eval_batches=1", "train.tensorboard=false"]


def short(steps):
    return [f"train.steps={steps}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}"]


@pytest.fixture(scope="module")
def starter(tmp_path_factory):
    notes = []
    with WarmStarter(tmp_path_factory.mktemp("server") / "warm-start.log", notes.append) as started:
        yield started
    assert notes == []


def env(threads=1, **extra):
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}


def outcome(run):
    """The step losses and the final validation loss, as the trainer wrote them."""
    return [r["loss"] for r in read_metrics(run) if "loss" in r], json.loads((run / "result.json").read_text())["final_val_loss"]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_warm_trainer_writes_exactly_what_a_fresh_process_writes(starter, tmp_path, threads):
    runs = {}
    for name, start in (("plain", plain_start), ("warm", starter.start)):
        process = start(["train", "--out", str(tmp_path / name), *TINY, *short(6)], env(threads), tmp_path / f"{name}.log")
        assert isinstance(process, WarmTrainer) == (name == "warm")
        assert process.wait() == 0, (tmp_path / f"{name}.log").read_text()
        runs[name] = outcome(tmp_path / name)
    assert len(runs["plain"][0]) == 6 and runs["warm"] == runs["plain"]  # bitwise: fp32, same threads, same kernels
    assert (tmp_path / "warm.log").read_text().startswith("done: 6 steps")


@pytest.mark.parametrize("args", [["train", "--no-such-option"], ["train", "--config", "/nonexistent/run.yaml", "--out", "OUT"]])
def test_a_failing_command_exits_and_logs_as_a_fresh_process(starter, tmp_path, args):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    codes, logs = {}, {}
    for name, start in (("plain", plain_start), ("warm", starter.start)):
        codes[name] = start(args, env(), tmp_path / f"{name}.log").wait()
        logs[name] = (tmp_path / f"{name}.log").read_text()
    assert codes["warm"] == codes["plain"] == 2 and logs["warm"] == logs["plain"] and logs["warm"].strip()


def test_sigterm_stops_a_warm_trainer_with_a_checkpoint_and_it_resumes(starter, tmp_path):
    run = tmp_path / "run"
    trainer = starter.start(["train", "--out", str(run), *TINY, *short(2000)], env(), tmp_path / "train.log")
    deadline = time.time() + 60
    while not read_metrics(run):
        assert trainer.poll() is None and time.time() < deadline, (tmp_path / "train.log").read_text()
        time.sleep(0.02)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=60) == EX_TEMPFAIL
    stopped_at = int(latest_checkpoint(run).name.split("_")[1])
    assert 0 < stopped_at < 2000 and not (run / "result.json").exists()
    resumed = starter.start(["train", "--out", str(run), "--resume", "--no-progress"], env(), tmp_path / "train.log")
    assert resumed.wait() == 0
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 2001))  # each step once


def test_a_trainer_with_another_preloaded_library_starts_as_a_plain_process(starter, tmp_path):
    process = starter.start(["train", "--no-such-option"], env(LD_PRELOAD="libm.so.6"), tmp_path / "log")
    assert isinstance(process, subprocess.Popen) and process.wait() == 2


def test_without_its_server_trainers_start_plain_and_one_running_counts_as_failed(tmp_path):
    notes = []
    with WarmStarter(tmp_path / "warm-start.log", notes.append) as starter:
        orphan = starter.start(["train", "--out", str(tmp_path / "run"), *TINY, *short(2000)], env(), tmp_path / "train.log")
        while not read_metrics(tmp_path / "run"):
            assert orphan.poll() is None
            time.sleep(0.02)
        starter.server.kill()
        starter.server.wait()
        assert orphan.poll() is None  # it trains on without its parent
        os.kill(orphan.pid, signal.SIGTERM)
        assert orphan.wait(timeout=60) == LOST and (tmp_path / "train.log").read_text().endswith(LOST_NOTE)
        assert latest_checkpoint(tmp_path / "run") is not None  # the trainer itself stopped as it should
        fallback = starter.start(["train", "--no-such-option"], env(), tmp_path / "plain.log")
        assert isinstance(fallback, subprocess.Popen) and fallback.wait() == 2
    assert len(notes) == 1 and notes[0].startswith("warm start: the server ended (exit code -9")


def test_a_warm_trainer_runs_on_the_requested_threads_with_the_studys_peak(starter, tmp_path):
    # the peak is given for 2 threads only: a trainer left on the server's one thread would measure its own
    peaks = {"ROPELAB_CPU_PEAKS": "float32/2=1e30"}
    trainer = starter.start(["train", "--out", str(tmp_path / "run"), *TINY, *short(2)], env(2, **peaks), tmp_path / "log")
    assert trainer.wait() == 0
    assert all(0 < row["mfu"] < 1e-15 for row in read_metrics(tmp_path / "run") if "mfu" in row)


def test_a_probe_starts_its_trainers_from_the_server(starter, tmp_path):
    from ropelab.config import build_run_config
    from ropelab.study.engine import Layout, StudyPeaks, run_probes

    tree = build_run_config({"preset": "tiny-llama"}, overrides=[o for o in TINY if "=" in o]).to_dict()
    before = starter.requests
    probe = run_probes(tree, Layout(2, 1), tmp_path / "probe", tmp_path, steps=6, starter=starter, peaks=StudyPeaks())
    assert starter.requests == before + 2 and probe.wall_s > 0 and probe.step_s > 0


def test_a_study_whose_server_cannot_start_trains_its_runs_as_plain_processes(tmp_path, monkeypatch, capsys):
    from ropelab.study import warm_start
    from ropelab.study.grid import StudyConfig
    from ropelab.study.runner import run_study

    monkeypatch.setattr(warm_start, "READY_TIMEOUT_S", 0.0)
    base = {"model": {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 1, "d_ff": 64},
            "data": {"tokenizer": "bytes", "seq_len": 16}, "train": {"steps": 2, "micro_batch": 2, "eval_every": 2}}
    study = StudyConfig(name="t", base=base, grid={"seed": [0, 1]}, engine="auto")
    assert run_study(study, tmp_path / "s", jobs=2, live=False) == {"seed0": "done", "seed1": "done"}
    assert "warm start: the server did not start in 0 s" in capsys.readouterr().out


def test_an_exception_in_a_warm_trainer_is_a_traceback_in_its_log_and_exit_code_1(starter, tmp_path):
    # an argument that is not a string: argparse itself fails with a TypeError, as a bug in a command would
    assert starter.start(["train", "--out", 5], env(), tmp_path / "log").wait() == 1
    log = (tmp_path / "log").read_text()
    assert log.startswith("Traceback (most recent call last)") and "TypeError" in log
