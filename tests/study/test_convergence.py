"""Convergence of runs without a frontier: a validation loss still falling at the end is named."""

import json

import numpy as np

from ropelab.study.convergence import convergence_section, tail_slopes


def write_run(study, run_id, val_losses):
    folder = study / "runs" / run_id
    folder.mkdir(parents=True)
    rows = [{"step": 10 * (i + 1), "tokens": 1000 * (i + 1), "loss": loss, "val_loss": loss}
            for i, loss in enumerate(val_losses)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_a_falling_run_is_named_and_a_flat_one_is_not(tmp_path):
    tokens = 1000 * np.arange(1, 21)
    write_run(tmp_path, "falling", list(3.0 - 0.2 * np.log2(tokens / 1000)))
    write_run(tmp_path, "flat", list(2.0 + 0.001 * np.random.default_rng(0).standard_normal(20)))
    write_run(tmp_path, "short", [2.0, 1.9])  # too few evaluations to judge
    slopes = tail_slopes(tmp_path)
    assert set(slopes) == {"falling", "flat"}
    assert slopes["falling"].still_falling and abs(slopes["falling"].slope + 0.2) < 1e-9
    assert not slopes["flat"].still_falling
    section = convergence_section(tmp_path)
    assert "1 of 2 runs still falling" in section.markdown and "| falling | -0.2000 |" in section.markdown
