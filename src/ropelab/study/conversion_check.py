"""Where recovery has taken a conversion study's runs: each finished run started from `train.init_from`
measured against its source on the windows its conversion was checked on (`ropelab.sources.distance_to_source`),
into ``study_dir/conversion/held_out.json`` ({run id: {loss_source, loss_converted, kl_to_source, tokens}}).
A run measured once is kept; runs that finish later are added. The report's conversion section reads it."""

from __future__ import annotations

import json
from pathlib import Path

from ropelab.files import write_atomically
from ropelab.sources import distance_to_source
from ropelab.sources.runs import read_result

HELD_OUT = ("conversion", "held_out.json")


def read_held_out(study_dir: Path) -> dict[str, dict]:
    """What `evaluate_study_conversion` wrote, or {} where it is missing or unreadable."""
    try:
        measured = json.loads(Path(study_dir).joinpath(*HELD_OUT).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(measured, dict):
        return {}
    return {run: entry for run, entry in measured.items() if isinstance(entry, dict)}


def evaluate_study_conversion(study_dir: str | Path, run_ids: list[str]) -> dict[str, dict]:
    """Measures the runs of `run_ids` that started from a converted source (their result.json records
    `init_from.conversion`) and trained at least one step, adds them to the held-out file and returns it."""
    study_dir = Path(study_dir)
    measured = read_held_out(study_dir)
    todo = [run for run in run_ids if run not in measured and _recovered_from_conversion(study_dir / "runs" / run)]
    path = study_dir.joinpath(*HELD_OUT)
    for run in todo:
        measured[run] = distance_to_source(study_dir / "runs" / run)
        path.parent.mkdir(exist_ok=True)
        write_atomically(path, json.dumps(measured, indent=1) + "\n")  # each run kept as soon as measured
    return measured


def _recovered_from_conversion(run_dir: Path) -> bool:
    result = read_result(run_dir)
    return bool(result and result["steps"] and (result.get("init_from") or {}).get("conversion"))
