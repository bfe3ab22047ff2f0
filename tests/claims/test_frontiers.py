"""`ropelab.claims.frontiers`: the regime a frontier verdict speaks about."""

from tests.claims.rigged import write_frontier_study

from ropelab.claims.frontiers import regime
from ropelab.claims.study_folder import StudyFolder


def test_the_regime_gives_the_sizes_the_budgets_and_the_most_passes_over_the_data(tmp_path):
    study = StudyFolder(write_frontier_study(tmp_path / "s", {"nope": 0.5, "rope100": 0.0}, budgets=(5.0, 10.0),
                                             corpus_tokens=2_500_000))
    assert regime(study) == ("5-10 tokens per non-embedding parameter (50k-100k parameters; up to 0.4 passes over "
                             "the training data)")
    assert regime(study, largest_only=True).startswith("10 tokens per non-embedding parameter (100k parameters; up to 0.4")


def test_runs_trained_before_passes_were_recorded_leave_them_out(tmp_path):
    study = StudyFolder(write_frontier_study(tmp_path / "s", {"nope": 0.5, "rope100": 0.0}, budgets=(5.0, 10.0)))
    assert regime(study) == "5-10 tokens per non-embedding parameter (50k-100k parameters)"
