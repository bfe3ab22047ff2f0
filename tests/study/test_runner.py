import json
import shutil
from pathlib import Path

import pytest
import yaml

from ropelab.config import ConfigError
from ropelab.study.engine import Layout
from ropelab.study.grid import StudyConfig
from ropelab.study.runner import run_study
from ropelab.train.checkpoint import latest_checkpoint
from ropelab.train.metrics import read_metrics


def losses(run):
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run)]

BASE = {
    "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 1, "d_ff": 64},
    "data": {"tokenizer": "bytes", "seq_len": 16},
    "train": {"steps": 4, "micro_batch": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2},
}


def write_engine_record(out, layout, base):
    """study.yaml and DIR/engine.json as `auto` leaves them after measuring: `layout` for the grid's one group."""
    import os
    from dataclasses import asdict

    from ropelab.study.engine import RECORD, group_key
    from ropelab.study.grid import expand
    from ropelab.study.runner import record_study

    grid = StudyConfig(name="t", base=base, grid={"model.rope.fraction": [0.0, 1.0]})
    record_study(out, grid, expand(grid))
    key = group_key(expand(grid)[0].config)
    (out / RECORD).write_text(json.dumps({"engine": "auto", "cores": os.cpu_count(), "groups": {
        key: {"chosen": asdict(layout), "measured": [], "notes": ["written by the test"]}}}))


def study(**grid):
    return StudyConfig(name="t", base=BASE, grid=grid or {"model.rope.fraction": [0.0, 1.0]})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Read-only: the two-run study, finished (tests copy it before changing anything)."""
    out = tmp_path_factory.mktemp("finished") / "study"
    assert run_study(study(), out, jobs=2, live=False) == {"fraction0": "done", "fraction1": "done"}
    return out


def copy_of(finished, tmp_path):
    return Path(shutil.copytree(finished, tmp_path / "study"))


def test_runs_finish_and_are_never_recomputed(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    assert (out / "engine" / "warm-start.log").is_file()  # auto: the trainers were forked from the warm-start server
    metrics = (out / "runs/fraction0/metrics.jsonl").read_text()
    assert run_study(study(), out, live=False) == {"fraction0": "done", "fraction1": "done"}
    assert (out / "runs/fraction0/metrics.jsonl").read_text() == metrics


def test_unfinished_run_resumes_from_its_checkpoint(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    run = out / "runs/fraction1"
    full = losses(run)
    (run / "result.json").unlink()
    last = latest_checkpoint(run)
    last.rename(last.parent / ".deleted")  # as if the run died after its step-2 checkpoint
    assert run_study(study(), out, live=False)["fraction1"] == "done"
    assert losses(run) == full


def test_a_different_grid_is_refused(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    with pytest.raises(ConfigError, match="different grid"):
        run_study(study(**{"model.rope.fraction": [0.5]}), out, live=False)


def test_a_study_recorded_before_a_config_key_existed_goes_on(finished, tmp_path):
    """study.yaml written by a ropelab without `model.position` (before the position registry): the
    same grid, read back with today's defaults, so the finished runs count as done."""
    out = copy_of(finished, tmp_path)
    record = yaml.safe_load((out / "study.yaml").read_text())
    for config in record["runs"].values():
        del config["model"]["position"]
    (out / "study.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    assert run_study(study(), out, live=False) == {"fraction0": "done", "fraction1": "done"}
    with pytest.raises(ConfigError, match="different grid"):
        run_study(study(**{"model.rope.fraction": [0.0, 0.5]}), out, live=False)


def test_a_crashing_run_is_marked_failed_and_others_go_on(tmp_path):
    variants = [{"name": "broken", "data.tokenizer": str(tmp_path / "missing.json")}, {"name": "ok"}]
    statuses = run_study(StudyConfig(name="t", base=BASE, variants=variants), tmp_path, jobs=2, live=False)
    assert statuses == {"broken": "failed", "ok": "done"}
    assert (tmp_path / "engine" / "warm-start.log").is_file()  # auto (the default): both forked from the warm-start server
    assert "missing.json" in (tmp_path / "runs/broken/error.txt").read_text()
    assert json.loads((tmp_path / "runs/ok/result.json").read_text())["steps"] == 4


def test_study_command_writes_every_output(tmp_path, capsys):
    from ropelab.cli import main

    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"name": "cli", "base": BASE, "grid": {"model.rope.fraction": [0.0, 1.0]}}))
    assert main(["study", "--config", str(config), "--out", str(tmp_path / "s"), "--no-live", "--jobs", "2"]) == 0
    assert "2/2 runs finished" in capsys.readouterr().out
    for name in ("summary.csv", "summary.json", "loss_curves.png", "final_loss.png", "report.md", "report.html"):
        assert (tmp_path / "s" / name).stat().st_size > 0
    assert main(["report", str(tmp_path / "s"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.html").is_file()


def _processes_naming(path) -> list[str]:
    """Command lines of the live processes that name `path` (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if str(path) in text:
            found.append(text)
    return found


def test_stacked_members_train_in_one_process_into_their_own_folders(finished, tmp_path):
    out = tmp_path / "stacked"
    write_engine_record(out, Layout(1, 2, stack=2), BASE)
    assert run_study(study(), out, live=False) == {"fraction0": "done", "fraction1": "done"}
    assert (out / "engine" / "stacks" / "fraction0.log").is_file()  # one process trained both
    for name in ("fraction0", "fraction1"):
        alone, stacked = losses(finished / "runs" / name), losses(out / "runs" / name)
        assert [row[0] for row in stacked] == [row[0] for row in alone]
        for (_, loss, val), (_, loss_alone, val_alone) in zip(stacked, alone):
            assert loss == pytest.approx(loss_alone, rel=1e-5)
            assert (val is None) == (val_alone is None) and (val is None or abs(val - val_alone) < 0.002)
        assert latest_checkpoint(out / "runs" / name) is not None


def test_a_diverging_stacked_member_fails_alone(tmp_path):
    # its first step throws the weights far off; each later loss is a spike (or not finite), and two stop it
    variants = [{"name": "wild", "train.lr": 1.0, "train.spike_factor": 1.5, "train.spike_window": 1, "train.max_bad_steps": 2},
                {"name": "ok"}]
    grid = StudyConfig(name="t", base=BASE, variants=variants)
    out = tmp_path / "s"
    from dataclasses import asdict

    from ropelab.study.engine import RECORD, group_key
    from ropelab.study.grid import expand
    from ropelab.study.runner import record_study

    record_study(out, grid, expand(grid))
    (out / RECORD).write_text(json.dumps({"engine": "auto", "cores": __import__("os").cpu_count(), "groups": {
        group_key(expand(grid)[0].config): {"chosen": asdict(Layout(1, 2, stack=2)), "measured": [], "notes": []}}}))
    statuses = run_study(grid, out, live=False)
    assert statuses == {"wild": "failed", "ok": "done"}, (out / "engine" / "stacks" / "wild.log").read_text()[-2000:]
    assert "consecutive bad steps" in (out / "runs/wild/error.txt").read_text()


@pytest.mark.parametrize("engine", ["eager", "auto", "stacked"])
def test_sigterm_stops_every_trainer_with_a_checkpoint_and_a_rerun_finishes(tmp_path, engine):
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from ropelab.train.lock import is_locked
    from ropelab.train.stop import EX_TEMPFAIL

    long_base = {**BASE, "train": {**BASE["train"], "steps": 1500, "eval_every": 1500, "checkpoint_every": 1500}}
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "base": long_base, "grid": {"model.rope.fraction": [0.0, 1.0]}}))
    out = tmp_path / "s"
    if engine != "eager":  # the choice of an earlier measurement, read back, not measured again
        # stacked: one process of both runs at 1 thread; the rerun resumes each alone, 2 x 1 thread as eager's
        write_engine_record(out, Layout(2, 1) if engine == "auto" else Layout(2, 1, stack=2), long_base)
    runs = [out / "runs" / name for name in ("fraction0", "fraction1")]
    study_process = subprocess.Popen([sys.executable, "-m", "ropelab", "study", "--config", config, "--out", out, "--no-live",
                                      "--jobs", "2", "--engine", "eager" if engine == "eager" else "auto"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not all(read_metrics(run) for run in runs):  # both trainers are past their first step
        assert study_process.poll() is None and time.time() < deadline, study_process.communicate()[1].decode()[-2000:]
        time.sleep(0.02)
    study_process.send_signal(signal.SIGTERM)
    _, stderr = study_process.communicate(timeout=60)
    assert study_process.returncode == EX_TEMPFAIL, stderr.decode()[-2000:]
    assert stderr.decode().splitlines() == [f"ropelab: {out}: stopped by SIGTERM (2 run(s) interrupted, their checkpoints "
                                            "kept); re-run the same command to continue"]
    assert _processes_naming(out) == []  # no trainer left behind
    for run in runs:
        stopped_at = latest_checkpoint(run)
        assert stopped_at is not None and 0 < int(stopped_at.name.split("_")[1]) < 1500
        assert not (run / "result.json").exists() and not (run / "error.txt").exists() and not is_locked(run)
    rerun = StudyConfig(name="t", base=long_base, grid={"model.rope.fraction": [0.0, 1.0]},
                        engine="eager" if engine == "eager" else "auto")
    assert run_study(rerun, out, jobs=2, live=False) == {"fraction0": "done", "fraction1": "done"}
    for run in runs:
        assert [r["step"] for r in read_metrics(run)] == list(range(1, 1501))  # each step once: resumed, not restarted


def test_ctrl_c_on_a_study_says_to_rerun_it(tmp_path, monkeypatch, capsys):
    from ropelab.cli import main
    from ropelab.study import pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_and_report", interrupted)
    assert main(["study", "--out", str(tmp_path / "s"), "--no-live", "--jobs", "1"]) == 130
    assert capsys.readouterr().err == "ropelab: interrupted; re-run the same command to continue (finished runs are kept)\n"
