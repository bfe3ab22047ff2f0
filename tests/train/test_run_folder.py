"""A run trains only into a folder of its own, and resumes only from its own checkpoints."""

import os
import shutil

import pytest
import yaml

from ropelab.cli import main
from ropelab.config import ConfigError, build_run_config
from ropelab.train import checkpoint as ckpt
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics


def listing(folder):
    """Every path under `folder` with its size and modification time: what "nothing changed" compares."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            found[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns)
    return found


def refused(argv, capsys):
    """The command's one error line (exit 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ropelab: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_session_overrides):
    """A finished 4-step run, checkpoints at steps 2 and 4 (read-only: tests copy it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    overrides = [*tiny_session_overrides, "train.steps=4", "train.checkpoint_every=2", "train.eval_every=2"]
    train(build_run_config(overrides=overrides), run_dir)
    return run_dir


@pytest.mark.parametrize("foreign", ["result.json", "checkpoints/step_00000004/COMPLETE", "notes.txt", "data/x.bin"])
def test_train_refuses_a_folder_holding_what_it_did_not_write(tmp_path, tiny_overrides, capsys, foreign):
    out = tmp_path / "out"
    (out / foreign).parent.mkdir(parents=True, exist_ok=True)
    (out / foreign).write_text("mine")
    before = listing(out)
    err = refused(["train", "--out", str(out), *tiny_overrides], capsys)
    assert f"holds {foreign.split('/')[0]}" in err and "ropelab train did not write" in err
    assert listing(out) == before
    with pytest.raises(ConfigError, match="did not write"):  # the library refuses too
        train(build_run_config(overrides=tiny_overrides), out)
    assert (out / foreign).read_text() == "mine"


def test_train_refuses_empty_out_and_a_file(tmp_path, tiny_overrides, capsys):
    assert "--out '': empty" in refused(["train", "--out", "", *tiny_overrides], capsys)
    file = tmp_path / "file"
    file.write_text("mine")
    assert "is not a folder" in refused(["train", "--out", str(file), *tiny_overrides], capsys)
    assert f"goes through {file}" in refused(["train", "--out", str(file / "run"), *tiny_overrides], capsys)
    assert "--out '': empty" in refused(["train", "--out", "", "--resume"], capsys)
    assert file.read_text() == "mine"


def test_train_takes_what_an_attempt_left_before_its_first_checkpoint(tmp_path, tiny_overrides):
    """A dead attempt's lock file, events and unfinished save, and a study runner's log: a new run starts."""
    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp_step_00000004").mkdir(parents=True)
    (out / "tensorboard").mkdir()
    for name in (".lock", "train.log"):
        (out / name).write_text("")
    result = train(build_run_config(overrides=tiny_overrides), out)
    assert result.steps == 8 and (out / "train.log").is_file()


def test_train_refuses_an_existing_run_without_resume(finished, tmp_path, tiny_overrides, capsys):
    run_dir = shutil.copytree(finished, tmp_path / "run")
    before = listing(run_dir)
    assert "already holds a run; pass --resume" in refused(["train", "--out", str(run_dir), *tiny_overrides], capsys)
    assert listing(run_dir) == before


@pytest.mark.parametrize("finished_before", [True, False], ids=["finished", "unfinished"])
def test_resume_takes_only_the_runs_own_checkpoints(finished, tmp_path, capsys, finished_before):
    """A foreign checkpoint is refused before anything else, even on a run that has nothing left to do."""
    mine = shutil.copytree(finished, tmp_path / "mine")
    other = shutil.copytree(finished, tmp_path / "other")
    if not finished_before:
        (mine / "result.json").unlink()
    foreign = ckpt.step_dir(other, 2)
    before = listing(mine)
    err = refused(["train", "--out", str(mine), "--resume", "--from-checkpoint", str(foreign)], capsys)
    assert f"not a checkpoint of {mine}" in err and f"train.init_from={foreign}" in err
    assert listing(mine) == before  # nothing pruned, nothing written
    if finished_before:
        return
    for own in (str(ckpt.step_dir(mine, 2)), "2"):  # a folder of its own, or a step number
        result = train(out_dir=mine, resume=True, from_checkpoint=own)
        assert result.steps == 4
        (mine / "result.json").unlink()


def test_resume_of_a_finished_run_with_a_result_missing_a_key_is_one_line(finished, tmp_path, capsys):
    """Before: a result.json without the trainer's final losses made `--resume` end in a TypeError traceback."""
    import json

    run_dir = shutil.copytree(finished, tmp_path / "run")
    result = json.loads((run_dir / "result.json").read_text())
    del result["final_val_loss"], result["wall_time_s"]
    (run_dir / "result.json").write_text(json.dumps(result))
    before = listing(run_dir)
    err = refused(["train", "--out", str(run_dir), "--resume"], capsys)
    assert "result.json: the file is damaged: no 'final_val_loss', 'wall_time_s' keys" in err
    after = listing(run_dir)
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_zero(tmp_path, tiny_overrides, capsys):
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(build_run_config(overrides=tiny_overrides), full)
    train(build_run_config(overrides=tiny_overrides), killed)
    shutil.rmtree(killed / "checkpoints")  # as a SIGKILL before the first save leaves it: config.yaml, a few rows
    (killed / "result.json").unlink()
    train(out_dir=killed, resume=True)
    assert "starting again from step 0" in capsys.readouterr().err
    assert [r["loss"] for r in read_metrics(killed)] == [r["loss"] for r in read_metrics(full)]


def test_an_edited_window_length_before_resume_is_refused(tmp_path, tiny_overrides):
    run = tmp_path / "run"
    train(build_run_config(overrides=tiny_overrides + ["train.steps=4", "train.checkpoint_every=2"]), run)
    (run / "result.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["seq_len"] = 16
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"trained at data.seq_len=32, but config.yaml now says 16"):
        train(out_dir=run, resume=True)
