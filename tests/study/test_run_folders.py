"""Reading a study's run folders: what state each run is in."""

from ropelab.study.run_folders import collect_runs


def test_a_finished_run_with_a_stale_error_file_counts_as_done(tmp_path):
    """A re-run (or a concurrent trainer) finished a run whose earlier attempt left error.txt."""
    run = tmp_path / "runs" / "r-seed0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "result.json").write_text('{"steps": 1, "final_val_loss": 2.0, "tokens": 8}')
    (run / "error.txt").write_text("exit code 1\n")
    (found,) = collect_runs(tmp_path)
    assert found.status == "done"
