"""Teacher targets computed once per study: runs that distill from the same teacher on the same batches
share one logits cache (`ropelab.distill.cache`) instead of each running the teacher.

With ``teacher_cache: true`` in the study YAML, runs whose `distill` section names a teacher (a source,
or ``"@<run id>"``: a teacher the study trains itself) are grouped by what their targets depend on
(teacher, temperature, top-k, and per phase the data, its order, batch shape, positions, document mask
and step count). Each group's cache is written once into ``DIR/teacher_cache/<key>/`` when the group's
first run is about to start (for a teacher of the study: once that teacher is done), and every run of the
group trains with `distill.logits_cache` pointing to it (the study record keeps the configs as written).
Runs with a KD weight of 0 (cross-entropy, KL logged) share it too. A cache holds top-k targets only:
every sharing run needs `distill.top_k`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ropelab.config import ConfigError, RunConfig
from ropelab.distill.cache import MANIFEST, cache_settings, cache_teacher_logits
from ropelab.study.grid import PlannedRun
from ropelab.train.phases import resolve_phases

FOLDER = "teacher_cache"


def _identity(run: PlannedRun) -> str:
    config = run.config
    d = config.distill
    phases = [(cache_settings(p.config), p.steps) for p in resolve_phases(config, config.train.data_parallel or 1)]
    text = json.dumps([d.teacher, d.temperature, d.top_k, d.teacher_precision, phases], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def shared_caches(runs: list[PlannedRun], study_dir: Path) -> dict[str, Path]:
    """{run id: its group's cache folder} for every run that can share teacher targets."""
    folders = {}
    for run in runs:
        d = run.config.distill
        if d is None or d.logits_cache or not d.teacher:
            continue
        if d.top_k is None:
            raise ConfigError(f"run {run.id}: teacher_cache needs distill.top_k (a cache holds top-k targets; "
                              "the whole vocabulary would take vocab x 6 bytes per token)")
        folders[run.id] = Path(study_dir) / FOLDER / _identity(run)
    return folders


def write_shared_cache(run_id: str, config: RunConfig, folders: dict[str, Path]) -> None:
    """Write the cache of the run's group unless it is complete: `config` is the run's, its teacher
    reference (``"@<run id>"``) already replaced by that run's folder."""
    folder = folders.get(run_id)
    if folder is not None and not (folder / MANIFEST).is_file():
        print(f"teacher targets for {', '.join(r for r, f in folders.items() if f == folder)} -> {folder}")
        cache_teacher_logits(config, folder)
