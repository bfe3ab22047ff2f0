"""Where the shipped claim studies and local lm-eval tasks live: the repository's ``configs/`` (the
claims run from a clone, as the README says)."""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
CLAIMS_CONFIGS = REPO_ROOT / "configs" / "claims"
EVAL_TASKS = REPO_ROOT / "configs" / "eval"


def claims_configs(folder: Path | None = None) -> Path:
    folder = Path(folder) if folder else CLAIMS_CONFIGS
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no claim studies here; run from a clone of ropelab or pass --configs DIR "
                          "(a folder of study YAMLs such as the repository's configs/claims)")
    return folder
