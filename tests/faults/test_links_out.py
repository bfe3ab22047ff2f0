"""A run folder with a link out of it (issue #52): run A's `checkpoints/` (or one step folder) a link to
run B's. `train --out A --resume` must not train from B's checkpoints nor prune them: it stops in one
line before anything is read or written, and B stays as it was, byte for byte."""

import hashlib
import os

import pytest
import yaml

from ropelab.config import ConfigError, build_run_config
from ropelab.study.grid import StudyConfig
from ropelab.study.runner import run_study
from ropelab.train.loop import train

from .helpers import assert_one_line, cli, fault_overrides, step_dir


def snapshot(folder):
    """{relative path: sha256} of every file under `folder`, links not followed."""
    found = {}
    for parent, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture(scope="module")
def run_b(tmp_path_factory, tiny_session_overrides, ropelab_cache):
    """A finished 8-step run keeping its step-6 and step-8 checkpoints (read-only)."""
    run = tmp_path_factory.mktemp("b") / "run"
    train(build_run_config(overrides=fault_overrides(tiny_session_overrides)), run)
    return run


def linked_to(run_b, a, what):
    """Run A: B's config with 4 steps more to train, and `what` (its checkpoints/ or its step 8) B's."""
    a.mkdir()
    config = yaml.safe_load((run_b / "config.yaml").read_text())
    config["train"]["steps"] = 12  # more steps: a resume would save (into B's checkpoints/) and prune
    (a / "config.yaml").write_text(yaml.safe_dump(config))
    (a / "metrics.jsonl").write_bytes((run_b / "metrics.jsonl").read_bytes())
    if what == "checkpoints":
        (a / "checkpoints").symlink_to(run_b / "checkpoints")
        return a / "checkpoints"
    (a / "checkpoints").mkdir()
    os.symlink(step_dir(run_b, 8), step_dir(a, 8))
    return step_dir(a, 8)


@pytest.mark.parametrize("what", ["checkpoints", "step"])
def test_a_resume_through_a_link_to_another_run_stops_and_leaves_it_untouched(run_b, tmp_path, capsys, what):
    b_before = snapshot(run_b)
    a = tmp_path / "a"
    link = linked_to(run_b, a, what)
    a_before = sorted(os.listdir(a))
    with pytest.raises(ConfigError, match="outside") as caught:
        train(out_dir=a, resume=True)  # before: trained steps 9-12 from B's step 8, then pruned B's steps
    assert str(caught.value).startswith(f"{link}: a link to {link.resolve()}, outside {a}; ropelab train writes")
    code, _, err = cli(["train", "--out", a, "--resume"], capsys)
    assert code == 2
    assert_one_line(err, f"ropelab: error: {link}: a link to", "nothing was changed")
    assert snapshot(run_b) == b_before
    assert sorted(os.listdir(a)) == a_before  # not even a .lock


def test_a_study_with_a_run_linked_out_stops_before_it_writes(run_b, tmp_path):
    out = tmp_path / "study"
    (out / "runs" / "r").mkdir(parents=True)
    (out / "runs" / "r" / "checkpoints").symlink_to(run_b / "checkpoints")
    base = yaml.safe_load((run_b / "config.yaml").read_text())
    with pytest.raises(ConfigError, match="outside"):
        run_study(StudyConfig(name="t", base=base, variants=[{"name": "r"}]), out, live=False)
    assert sorted(os.listdir(out)) == [".lock", "runs"]  # no study.yaml, no plan
