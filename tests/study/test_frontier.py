"""Frontier studies: a trunk per run, a cooldown branch per budget, and the points a fit reads."""

import pytest

from ropelab.cli import main
from ropelab.config import ConfigError, build_run_config
from ropelab.study.frontier import frontier_points, read_frontier_record
from ropelab.study.grid import StudyConfig, expand, resolve_references
from ropelab.study.runner import record_study, run_dir
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics
from ropelab.train.optim import lr_at

BASE = {
    "preset": "tiny-llama",
    "model": {"n_layer": 1, "d_model": 64, "n_head": 1, "n_kv_head": 1, "d_ff": 128},
    "data": {"corpus": "stdlib", "tokenizer": "bytes", "seq_len": 32},
    "train": {"micro_batch": 4, "lr": 3e-3, "eval_every": 40, "eval_batches": 2, "checkpoint_every": 1000,
              "progress": False, "precision": "fp32", "tensorboard": False},
}


def study(**frontier) -> StudyConfig:
    return StudyConfig(name="f", base=BASE, variants=[{"name": "rope100", "model.rope.fraction": 1.0}],
                       grid={"seed": [0]}, frontier={"budgets": [0.1, 0.2], **frontier})


def test_each_run_becomes_a_trunk_and_a_cooldown_per_budget():
    runs = {r.id: r for r in expand(study(reference=[0.2]))}
    assert list(runs) == ["rope100-seed0-trunk", "rope100-seed0-0.1tpp", "rope100-seed0-0.2tpp", "rope100-seed0-0.2tpp-ref"]
    trunk, short, long, ref = runs.values()
    params = trunk.frontier.params
    assert params == 41_152 and {r.frontier.params for r in runs.values()} == {params}
    per_step = 4 * 32
    assert short.config.train.steps == round(0.1 * params / per_step) and long.config.train.steps == round(0.2 * params / per_step)
    for branch in (short, long):
        tc = branch.config.train
        cooldown = round(0.2 * tc.steps)
        assert tc.branch_from == "@rope100-seed0-trunk" and tc.branch_step == tc.steps - cooldown
        assert tc.schedule == "wsd" and tc.warmup_steps == trunk.config.train.warmup_steps
        assert branch.frontier.tokens == tc.steps * per_step and branch.frontier.role == "cooldown"
    assert trunk.config.train.schedule == "constant"
    assert trunk.config.train.checkpoint_steps == [short.config.train.branch_step, long.config.train.branch_step]
    assert trunk.config.train.steps == long.config.train.branch_step
    assert ref.config.train.schedule == "cosine" and ref.config.train.branch_from is None
    assert ref.config.train.steps == long.config.train.steps and ref.frontier.role == "reference"


def test_the_branches_learning_rate_equals_the_trunks_until_their_cooldown():
    runs = {r.frontier.role + str(r.frontier.budget): r.config.train for r in expand(study())}
    trunk, branch = runs["trunkNone"], runs["cooldown0.2"]
    trunk_lr, branch_lr = ([lr_at(step, tc) for step in range(tc.steps)] for tc in (trunk, branch))
    assert branch_lr[:branch.branch_step] == trunk_lr[:branch.branch_step] and len(trunk_lr) == branch.branch_step
    cooldown = branch_lr[branch.branch_step:]
    assert cooldown[0] == trunk.lr and cooldown == sorted(cooldown, reverse=True) and cooldown[-1] < 0.4 * trunk.lr


@pytest.mark.parametrize("frontier, message", [
    ({"budgets": [0.001]}, "within the warm-up"),
    ({"budgets": [0.1, 0.1]}, "distinct"),
    ({"budgets": [0.1], "reference": [0.3]}, "not among"),
    ({"budgets": [0.1], "cooldown": 1.0}, "cooldown"),
    ({"budgets": [0.1], "unit": "flops"}, "unit"),
])
def test_bad_frontiers_are_refused(frontier, message):
    bad = study()
    bad.frontier = frontier
    with pytest.raises(ConfigError, match=message):
        expand(bad)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished frontier study, trained in the runner's order by hand in one process: the trunk, then
    each branch from its checkpoint."""
    folder = tmp_path_factory.mktemp("frontier")
    config = study()
    runs = expand(config)
    record_study(folder, config, runs)
    dirs = {r.id: str(run_dir(folder, r.id)) for r in runs}
    for run in runs:
        train(build_run_config(resolve_references(run.config, dirs)), dirs[run.id])
    return folder, runs


def test_a_frontier_study_trains_and_yields_its_points(trained):
    folder, runs = trained
    record = read_frontier_record(folder)
    assert {run_id: r.role for run_id, r in record.items()} == {r.id: r.frontier.role for r in runs}
    points = frontier_points(folder)
    assert [(p["variant"], p["seed"], p["budget"]) for p in points] == [("rope100", 0, 0.1), ("rope100", 0, 0.2)]
    for point in points:
        rows = read_metrics(run_dir(folder, point["run"]))
        assert rows[-1]["tokens"] == point["tokens"] and rows[-1]["val_loss"] == point["loss"]
        branch_step = next(r for r in runs if r.id == point["run"]).config.train.branch_step
        assert rows[0]["step"] == branch_step + 1  # the cooldown trains only its own steps


def test_fit_prints_the_frontier_and_writes_it_only_into_a_new_folder(trained, tmp_path, capsys):
    folder, _ = trained
    assert main(["fit", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Frontier: final loss per budget" in out and "0.1 tokens/param" in out and "0.2 tokens/param" in out
    assert "No fit: a scaling-law fit needs at least 3 token budgets per variant and model size, and this study " \
           "has at most 2." in out
    assert main(["fit", str(folder), "--out", str(tmp_path / "fit")]) == 0
    assert "| rope100 | 41,152 |" in (tmp_path / "fit" / "fit.md").read_text()
    assert main(["fit", str(folder), "--out", str(tmp_path / "fit")]) == 2  # not empty now: refused
    assert "not empty" in capsys.readouterr().err


def test_fit_of_a_folder_without_a_frontier_is_one_line(tmp_path, capsys):
    assert main(["fit", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no finished frontier runs" in err and len(err.strip().splitlines()) == 1
