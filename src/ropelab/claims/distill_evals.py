"""What the distillation seed's claims read from their study folder (`StudyFolder`), and the
evaluations they add after training, each kept under ``<study>/claims/`` and skipped when it is there:

  probe-<run>/      `ropelab probe` on the run's phase-1 and phase-2 checkpoints, causal attention with
                    running positions and a document mask with restarting positions (`PROBE_MODES`),
                    plus the weight updates between the two (weights_<a>__<b>.json)
  probe-teacher/    the same probe on the teacher (SmolLM2 itself, or the study's teacher run)
  longctx-teacher/  the teacher's own passkey and RULER needle retrieval at the study's lengths, where
                    the study's long-context evaluation has no entry of it
  teacher-advantage.json  the teacher against a CE student (`ropelab.claims.teacher_advantage`)

A run that did not finish gives NaN values, so that its group is inconclusive rather than silently
smaller.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

from ropelab.claims.study_folder import StudyFolder
from ropelab.config import ConfigError, RunConfig
from ropelab.evaluate.longctx import evaluate_longctx
from ropelab.probe.config import ProbeConfig, parse_modes
from ropelab.probe.runner import run_probe
from ropelab.study.run_folders import Run
from ropelab.study.sections import LONGCTX_DIR
from ropelab.train.checkpoint import phase_checkpoints
from ropelab.train.phases import resolve_phases

TEACHER = "smollm2-135m"  # the built-in source the study distills from
CAUSAL, DOC = "causal-fp32-running", "doc-fp32-restart"
PROBE_MODES = parse_modes(f"{CAUSAL},{DOC}")
NAN = float("nan")


def final_val_losses(study: StudyFolder, variants: Sequence[str]) -> dict[str, list[float]]:
    """{variant: each seed's final validation loss, as its result.json gives it}."""
    def loss(run: Run) -> float:
        value = (run.result or {}).get("final_val_loss")
        return NAN if value is None else float(value)

    return {variant: [loss(run) for run in study.seed_runs(variant)] for variant in variants}


def first_config(study: StudyFolder, variant: str) -> RunConfig:
    """The config of `variant`'s first seed (the seeds share everything else)."""
    return study.config(study.seed_runs(variant)[0])


def phase_lengths(study: StudyFolder, variant: str) -> list[int]:
    """The training window of each phase."""
    return [phase.config.data.seq_len for phase in resolve_phases(first_config(study, variant))]


# ------------------------------------------------------------------ the study's long-context evaluation


def longctx_results(study: StudyFolder) -> dict:
    path = study.path / LONGCTX_DIR / "longctx.json"
    if not path.is_file():
        raise ConfigError(f"claims: {path} is missing: the study's long-context evaluation has not run")
    return json.loads(path.read_text())


def loss_curves(results: dict, study: StudyFolder, variants: Sequence[str]) -> tuple[list[int], dict[str, list[list[float]]]]:
    """(first position of each bucket, {variant: the loss-by-position curve of each seed})."""
    entries = {entry["label"]: entry for entry in results["runs"]}
    positions = None
    curves: dict[str, list[list[float]]] = {}
    for variant in variants:
        curves[variant] = []
        for run in study.seed_runs(variant):
            buckets = (entries.get(run.id) or {}).get("loss_by_position", {}).get("buckets")
            if buckets:
                positions = positions or [b["start"] for b in buckets]
            curves[variant].append([b["loss"] for b in buckets] if buckets else None)
    if positions is None:
        raise ConfigError(f"claims: {study.path}/{LONGCTX_DIR} holds no loss by position of {', '.join(variants)}")
    return positions, {v: [c if c is not None else [NAN] * len(positions) for c in cs] for v, cs in curves.items()}


def retrieval_by_length(entry: dict, task: str, metric: str) -> dict[int, float]:
    """{prompt length: `metric` of `task` averaged over depths} of one run's long-context entry."""
    cells = entry.get("tasks", {}).get(task, {}).get("cells", [])
    lengths = sorted({cell["length"] for cell in cells})
    return {n: sum(c[metric] for c in cells if c["length"] == n) / sum(c["length"] == n for c in cells) for n in lengths}


def teacher_longctx(study: StudyFolder, results: dict, source: str = TEACHER) -> dict:
    """The teacher's own long-context entry on the study's retrieval tasks, lengths and depths: the
    study's own entry for a teacher the study trained (a folder under its runs/), else evaluated (one
    item per passkey cell, the study's items per RULER length) and kept in ``claims/longctx-teacher``."""
    if Path(source).parent == study.path / "runs":
        entry = next((e for e in results["runs"] if e["label"] == Path(source).name), None)
        if entry is not None:
            return entry
    folder = study.path / "claims" / "longctx-teacher"
    path = folder / "longctx.json"
    if not path.is_file():
        settings = results["settings"]
        evaluate_longctx([source], folder, tasks=retrieval_tasks(settings), lengths=settings["lengths"],
                         depths=settings["depths"], items=settings["items"], distractors=settings["distractors"],
                         answer_alphabet=settings.get("answer_alphabet", "digits"), loss_windows=0, seed=settings["seed"], progress=False)
    return json.loads(path.read_text())["runs"][0]


def retrieval_tasks(settings: dict) -> list[str]:
    """The study's retrieval tasks: the passkey and RULER's needle tasks (not the loss by position)."""
    return [task for task in settings["tasks"] if task == "passkey" or task.startswith("niah")]


# ------------------------------------------------------------------ the probe


def _probe(sources: list[str], folder: Path, block_len: int, repeats: int) -> Path:
    if not (folder / "probe.json").is_file():
        run_probe(sources, folder, ProbeConfig(block_len=block_len, repeats=repeats, modes=PROBE_MODES,
                                               stages=("logits",), progress=False))
    return folder


def probe_shape(study: StudyFolder, variant: str) -> tuple[int, int]:
    """(block length, repeats) of the probe: blocks of the phase-1 window filling the phase-2 window."""
    lengths = phase_lengths(study, variant)
    return lengths[0], max(2, lengths[-1] // lengths[0])


def probe_run(study: StudyFolder, run: Run, shape: tuple[int, int]) -> Path | None:
    """The probe folder of a finished run (its first and last phase's checkpoints), made if absent;
    None for a run that did not finish."""
    folder = study.path / "claims" / f"probe-{run.id}"
    if (folder / "probe.json").is_file():
        return folder
    if run.result is None:
        return None
    phases = [p.name for p in resolve_phases(study.config(run))]
    checkpoints = phase_checkpoints(run.path)
    missing = [name for name in (phases[0], phases[-1]) if name not in checkpoints]
    if missing:
        raise ConfigError(f"claims: {run.path} has no checkpoint at the end of phase {missing[0]!r}")
    return _probe([str(checkpoints[phases[0]]), str(checkpoints[phases[-1]])], folder, *shape)


def probe_teacher(study: StudyFolder, shape: tuple[int, int], source: str = TEACHER) -> Path:
    return _probe([source], study.path / "claims" / "probe-teacher", *shape)


def probe_labels(folder: Path) -> list[str]:
    """The probed checkpoints' labels, in the order given (phase 1, then phase 2)."""
    return [c["label"] for c in json.loads((folder / "probe.json").read_text())["checkpoints"]]


def logit_kl(folder: Path | None, index: int, mode: str) -> float:
    """Mean KL of the later repeats' next-token distributions to the first repeat's, at checkpoint
    `index` of the probe folder; NaN without a folder."""
    if folder is None:
        return NAN
    found = json.loads((folder / probe_labels(folder)[index] / mode / "metrics.json").read_text())
    return float(found["captures"]["logits"]["mean_kl"])


def logit_kl_by_repeat(folder: Path, index: int, mode: str) -> list[float]:
    found = json.loads((folder / probe_labels(folder)[index] / mode / "metrics.json").read_text())
    return found["captures"]["logits"]["kl"]


def query_change_per_pair(folder: Path | None, pairs: int) -> list[float]:
    """Relative change of W_q per rotary pair from the phase-1 to the phase-2 checkpoint (each
    layer's ratio over all heads, averaged over layers); NaN without a folder."""
    if folder is None:
        return [NAN] * pairs
    first, last = probe_labels(folder)
    layers = json.loads((folder / f"weights_{first}__{last}.json").read_text())["layers"]
    per_layer = [layer["q"]["per_pair"] for layer in layers]
    return [math.fsum(values) / len(values) for values in zip(*per_layer)]


def band_means(per_pair: Sequence[float], bands: Mapping[str, range]) -> dict[str, float]:
    return {name: math.fsum(per_pair[i] for i in pairs) / len(pairs) for name, pairs in bands.items()}
