"""`ropelab claims`: run the studies the chosen claims need, judge each claim, write one report.

Every study is an ordinary study config under ``configs/claims/`` and runs into ``<out>/<stem>/``
through the study pipeline, so finished runs (and the judges' cached evaluations) are skipped when
the command is run again. Each study's wall time is kept in ``<out>/timings.json``, summed over
invocations, for the report.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from ropelab.claims.claim import Claim, Finding
from ropelab.claims.distill import DISTILL_CLAIMS
from ropelab.claims.estimate import study_estimate
from ropelab.claims.partial import PARTIAL_CLAIMS
from ropelab.claims.paths import claims_configs
from ropelab.claims.report import write_claims_report
from ropelab.claims.verdict import INCONCLUSIVE, Verdict
from ropelab.config import ConfigError
from ropelab.files import write_atomically
from ropelab.machine import describe
from ropelab.study.grid import StudyConfig, load_study
from ropelab.study.pipeline import run_and_report

CLAIMS: list[Claim] = [*PARTIAL_CLAIMS, *DISTILL_CLAIMS]


def select(only: Optional[Sequence[str]] = None) -> list[Claim]:
    """The claims named in `only`, in table order: ids matched exactly, or a seed's number ("000", or
    "0": any digits of the same value) for the claims that decide it (a second, labelled setting is
    chosen by its ids); every claim when `only` is empty."""
    if not only:
        return list(CLAIMS)

    def named(claim: Claim, name: str) -> bool:
        return name == claim.id or (claim.decides and name.isascii() and name.isdigit()
                                    and int(name) == int(claim.seed_number))

    for name in only:
        if not any(named(c, name) for c in CLAIMS):
            seeds = ", ".join(dict.fromkeys(c.seed_number for c in CLAIMS))
            raise ConfigError(f"--only: unknown claim or seed {name!r}; choose claim ids from "
                              f"{', '.join(c.id for c in CLAIMS)}, or a seed number: {seeds}")
    return [c for c in CLAIMS if any(named(c, name) for name in only)]


def needed_studies(claims: Sequence[Claim], configs: Optional[Path] = None) -> dict[str, StudyConfig]:
    """{stem: study config} of every study the claims need, loaded (and checked) before any run."""
    folder = claims_configs(configs)
    studies = {}
    for claim in claims:
        for stem in claim.studies:
            if stem not in studies:
                path = folder / f"{stem}.yaml"
                if not path.is_file():
                    raise ConfigError(f"{path}: claim {claim.id!r} needs this study config, and it is missing")
                studies[stem] = load_study(path)
    return studies


def plan_claims(only: Optional[Sequence[str]] = None, jobs: int = 1, configs: Optional[Path] = None) -> list[dict]:
    """The dry run: per study its runs, tokens and expected CPU time at `jobs` runs at once; per
    claim the studies it needs. Measures a few training steps of each model shape (seconds)."""
    claims = select(only)
    studies = needed_studies(claims, configs)
    return [{"study": stem, "claims": [c.id for c in claims if stem in c.studies], **study_estimate(study, jobs)}
            for stem, study in studies.items()]


def _timings(out: Path) -> dict:
    path = out / "timings.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_timings(out: Path, timings: dict) -> None:
    write_atomically(out / "timings.json", json.dumps(timings, indent=2))


def _judge(claim: Claim, folders: dict[str, Path], statuses: dict[str, dict]) -> Finding:
    """The claim's finding; inconclusive with the reason when a study it needs has failed runs or
    its judge cannot read them."""
    failed = [f"{stem}/{run}" for stem in claim.studies for run, status in statuses[stem].items() if status != "done"]
    try:
        finding = claim.judge({stem: folders[stem] for stem in claim.studies})
    except (ConfigError, FileNotFoundError, KeyError, ValueError) as exc:
        return Finding(measured=f"not judged: {exc}", verdict=Verdict(INCONCLUSIVE, f"the judge could not read the studies: {exc}"))
    if failed:
        note = f"runs that did not finish: {', '.join(failed)}. " + finding.note
        return dataclasses.replace(finding, note=note)
    return finding


def run_claims(only: Optional[Sequence[str]] = None, out: str | Path = "claims", jobs: int = 1, live: bool = True,
               configs: Optional[Path] = None) -> dict:
    """Run the claims' studies into `out`, judge every chosen claim and write claims.html, claims.md
    and claims.json there. Returns {"findings": {id: Finding}, "report": {name: path}}."""
    claims = select(only)
    studies = needed_studies(claims, configs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings, statuses, folders = _timings(out), {}, {}
    for stem, study in studies.items():
        folders[stem] = out / stem
        started = time.perf_counter()
        statuses[stem] = run_and_report(study, folders[stem], jobs=jobs, live=live)["statuses"]
        timings[stem] = timings.get(stem, 0.0) + time.perf_counter() - started
        _save_timings(out, timings)
    findings = {}
    for claim in claims:
        started = time.perf_counter()
        findings[claim.id] = _judge(claim, folders, statuses)
        timings[f"judge {claim.id}"] = time.perf_counter() - started  # evaluations cached: the last call's time
    _save_timings(out, timings)
    meta = {
        "command": "ropelab claims " + (f"--only {','.join(only)} " if only else "") + f"--out {out} --jobs {jobs}",
        "machine": f"{describe()}, {platform.platform()}",
        "studies": [{"name": stem, "runs": len(statuses[stem]), "tokens": study_estimate(studies[stem], jobs, measure=False)["tokens"],
                     "seconds": round(timings[stem], 1),
                     "status": ", ".join(f"{n} {s}" for s, n in Counter(statuses[stem].values()).items())} for stem in studies],
        "judging seconds": round(sum(v for k, v in timings.items() if k.startswith("judge ")), 1),
    }
    report = write_claims_report(out, [(c, findings[c.id]) for c in claims], meta)
    return {"findings": findings, "report": report}

