import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ropelab.config import ConfigError, build_run_config
from ropelab.data.pipeline import build_loaders
from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics


def losses(run_dir):
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run_dir)]


def test_loss_falls_and_outputs_exist(tmp_path, tiny_overrides):
    result = train(build_run_config(overrides=tiny_overrides + ["train.steps=30", "train.eval_every=10"]), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["loss"] > rows[-1]["loss"] + 0.5
    assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "mfu"} <= set(rows[0])
    assert 0 < rows[-1]["mfu"] < 1 and rows[-1]["tokens_per_s_per_device"] > 0
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert (tmp_path / "run" / "config.yaml").is_file() and result.final_val_loss < rows[0]["loss"]
    assert (ckpt.latest_checkpoint(tmp_path / "run") / "model.safetensors").is_file()
    # the passes over the training split: 30 steps of the global batch over the windows the split holds
    windows = build_loaders(result_config(tmp_path / "run"))[0].num_windows
    tc = result_config(tmp_path / "run").train
    expected = 30 * tc.global_batch / windows
    assert result.data_passes == pytest.approx(expected)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["data_passes"] == pytest.approx(expected)


def result_config(run_dir):
    from ropelab.sources.runs import read_run_config

    return read_run_config(run_dir)


def test_data_passes_sum_each_phase_windows_over_its_split():
    from types import SimpleNamespace

    from ropelab.train.loop import data_passes

    def phase(start, end, batch, windows):
        return SimpleNamespace(start=start, end=end, config=SimpleNamespace(train=SimpleNamespace(global_batch=batch)),
                               windows=windows)

    phases = [phase(0, 100, 8, 400), phase(100, 150, 2, 10)]
    loader = lambda p: SimpleNamespace(num_windows=p.windows)  # noqa: E731
    assert data_passes(phases, 50, loader) == pytest.approx(1.0)
    assert data_passes(phases, 150, loader) == pytest.approx(2.0 + 10.0)
    assert data_passes(phases, 0, loader) == 0.0


def test_resume_in_process_matches_uninterrupted(tmp_path, tiny_overrides):
    full = tmp_path / "full"
    train(build_run_config(overrides=tiny_overrides), full)
    part = tmp_path / "part"
    train(build_run_config(overrides=tiny_overrides + ["train.steps=8"]), part)
    # cut the run back to its step-4 checkpoint, as a crash after step 6 would leave it
    import shutil

    shutil.rmtree(ckpt.checkpoint_dir(part) / "step_00000008")
    (part / "result.json").unlink()
    train(out_dir=part, resume=True)
    assert losses(part) == losses(full)


def _spawn(run_dir, overrides):
    cmd = [sys.executable, "-m", "ropelab", "train", "--out", str(run_dir), *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_step(run_dir, step, proc, timeout=120):
    start = time.time()
    while time.time() - start < timeout:
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the run")


GRACE_S = 30  # as Kubernetes' default terminationGracePeriodSeconds: SIGKILL follows if it has not exited


@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 130), (signal.SIGTERM, 75)],
                         ids=["sigkill", "sigint", "sigterm"])
def test_interrupt_and_resume_gives_same_losses(tmp_path, tiny_overrides, sig, code):
    overrides = tiny_overrides + ["train.steps=60", "train.checkpoint_every=5", "train.eval_every=50"]
    reference = tmp_path / "reference"
    torch.set_num_threads(1)
    train(build_run_config(overrides=overrides), reference)
    run = tmp_path / "run"
    proc = _spawn(run, overrides)
    _wait_for_step(run, 12, proc)
    proc.send_signal(sig)
    try:
        assert proc.wait(timeout=GRACE_S) == code
    finally:
        proc.kill()
    stderr = proc.stderr.read().decode()
    if sig != signal.SIGKILL:  # stopped at a step boundary with a checkpoint there, in one line
        stopped_at = ckpt.latest_checkpoint(run)
        assert len(stderr.splitlines()) == 1 and "--resume" in stderr and str(stopped_at) in stderr, stderr
        assert read_metrics(run)[-1]["step"] == int(stopped_at.name.split("_")[1])
    assert not (run / "result.json").exists(), "the run finished before it could be interrupted"
    assert ckpt.latest_checkpoint(run) is not None
    resumed = subprocess.run([sys.executable, "-m", "ropelab", "train", "--out", str(run), "--resume"],
                             capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    assert losses(run) == losses(reference)


def test_existing_run_is_never_overwritten(tmp_path, tiny_overrides):
    run = tmp_path / "run"
    train(build_run_config(overrides=tiny_overrides + ["train.steps=4"]), run)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        train(build_run_config(overrides=tiny_overrides), run)
    assert (run / "metrics.jsonl").read_text() == before


def test_resume_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config.yaml"):
        train(out_dir=tmp_path / "empty", resume=True)


def test_incomplete_checkpoint_is_ignored(tmp_path, tiny_overrides):
    run = tmp_path / "run"
    train(build_run_config(overrides=tiny_overrides + ["train.steps=4"]), run)
    fake = ckpt.checkpoint_dir(run) / "step_00000099"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(run).name == "step_00000004"


def test_resume_of_finished_run_does_nothing(tmp_path, tiny_overrides, capsys):
    run = tmp_path / "run"
    first = train(build_run_config(overrides=tiny_overrides + ["train.steps=4"]), run)
    again = train(out_dir=run, resume=True)
    assert "nothing to do" in capsys.readouterr().out and again.steps == first.steps


def test_tiny_llama_preset_trains_from_the_cli(tmp_path):
    from ropelab.cli import main

    code = main(["train", "--preset", "tiny-llama", "--out", str(tmp_path / "r"), "--no-progress",
                 "data.tokenizer=bytes", "data.seq_len=64", "train.steps=3", "train.micro_batch=2", "train.eval_batches=1"])
    assert code == 0
    assert json.loads((tmp_path / "r" / "result.json").read_text())["steps"] == 3


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path, tiny_overrides):
    def interrupt_at_step_3(row):
        if row["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-loop; the step in progress completes

    with pytest.raises(KeyboardInterrupt):
        train(build_run_config(overrides=tiny_overrides), tmp_path / "run", callbacks=(interrupt_at_step_3,))
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000003"
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    train(out_dir=tmp_path / "run", resume=True)
    train(build_run_config(overrides=tiny_overrides), tmp_path / "reference")
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")


def test_checkpoints_without_full_weights_load_from_their_shards(tmp_path, tiny_overrides):
    from ropelab.sources import load

    run = tmp_path / "run"
    train(build_run_config(overrides=tiny_overrides + ["train.full_weights=boundaries"]), run)
    first, last = ckpt.list_checkpoints(run)
    assert not (first / ckpt.WEIGHTS).exists() and (last / ckpt.WEIGHTS).is_file()
    assert ckpt.weights_vocab(first) == ckpt.weights_vocab(last)
    from_shards = load(first).model.state_dict()
    trainers_way, _, _ = load(last)
    final = {name: t.clone() for name, t in trainers_way.state_dict().items()}
    ckpt.load_checkpoint(first, trainers_way)  # the same shards, read as a resume reads them
    assert all(torch.equal(t, trainers_way.state_dict()[name]) for name, t in from_shards.items())
    assert not all(torch.equal(t, final[name]) for name, t in from_shards.items())


@pytest.mark.parametrize("setting, calls", [("true", 1), ("false", 0)])
def test_cpu_runs_keep_freed_memory_unless_told_not_to(tmp_path, tiny_overrides, monkeypatch, setting, calls):
    import ropelab.train.loop as loop

    made = []
    monkeypatch.setattr(loop, "reuse_freed_memory", lambda: made.append(True))
    train(build_run_config(overrides=tiny_overrides + ["train.steps=1", f"train.reuse_freed_memory={setting}"]),
          tmp_path / "run")
    assert len(made) == calls
