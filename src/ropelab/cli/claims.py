"""`ropelab claims`: every claim of both seeds put to a tiny-scale test, one report with a verdict each."""

from __future__ import annotations

import argparse

from ropelab.cli.common import Command, positive_int
from ropelab.files import output_folder, writable_folder


def _add_claims(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", help="comma-separated claim ids (rq1,...,spikes,kd-beats-ce,...) or seed numbers "
                                  "(000 or 0, 001 or 1), matched exactly")
    p.add_argument("--out", default="claims", help="folder for the studies and claims.html/md/json (default: ./claims)")
    p.add_argument("--jobs", type=positive_int, default=2, help="runs trained at once, CPU threads split between them (default 2)")
    p.add_argument("--configs", help="folder of the claim studies (default: the repository's configs/claims)")
    p.add_argument("--dry-run", action="store_true", help="print each study's runs, tokens and expected time, and stop")
    p.add_argument("--no-live", action="store_true", help="no live overview (print a table at the end)")


def _print_plan(rows: list[dict], jobs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    minutes = lambda seconds: f"{seconds / 60:.1f} min"  # noqa: E731
    table = Table(title=f"claims plan: expected time with --jobs {jobs} on this machine (measured training steps)")
    for column in ("study", "claims", "runs", "tokens", "tokens per non-emb. param", "teacher", "expected"):
        table.add_column(column, justify="left" if column in ("study", "claims") else "right")
    for row in rows:
        table.add_row(row["study"], ", ".join(row["claims"]), str(len(row["runs"])), f"{row['tokens']:,}",
                      f"{row['tokens_per_param']:.3g}", minutes(row["teacher_seconds"]) if row["teacher_seconds"] else "",
                      minutes(row["seconds"]))
    table.add_row("total", "", str(sum(len(r["runs"]) for r in rows)), f"{sum(r['tokens'] for r in rows):,}", "", "",
                  minutes(sum(r["seconds"] for r in rows)))
    by_claim = Table(title="per claim: the studies it reads (a study shared by several claims runs once)")
    for column in ("claim", "studies", "runs", "tokens", "expected"):
        by_claim.add_column(column, justify="left" if column in ("claim", "studies") else "right")
    for claim in dict.fromkeys(c for row in rows for c in row["claims"]):
        mine = [row for row in rows if claim in row["claims"]]
        by_claim.add_row(claim, ", ".join(r["study"] for r in mine), str(sum(len(r["runs"]) for r in mine)),
                         f"{sum(r['tokens'] for r in mine):,}", minutes(sum(r["seconds"] for r in mine)))
    Console().print(table)
    Console().print(by_claim)


def cmd_claims(args: argparse.Namespace) -> int:
    from ropelab.claims.report import FIGURES
    from ropelab.claims.runner import CLAIMS, plan_claims, run_claims

    only = [name.strip() for name in args.only.split(",") if name.strip()] if args.only else None
    if args.dry_run:
        _print_plan(plan_claims(only, args.jobs, args.configs), args.jobs)
        return 0
    studies = sorted({stem for claim in CLAIMS for stem in claim.studies})  # one folder each
    writable_folder(output_folder(args.out, "ropelab claims", ("claims.html", "claims.md", "claims.json", FIGURES,
                                                               "timings.json", ".*.partial", *studies)))
    outcome = run_claims(only, args.out, args.jobs, live=not args.no_live, configs=args.configs)
    for claim_id, finding in outcome["findings"].items():
        print(f"{claim_id}: {finding.verdict.outcome}")
    print(f"report: {outcome['report']['claims.html']}")
    return 0


COMMANDS: list[Command] = [
    ("claims", _add_claims, cmd_claims, "run a tiny-scale test of every claim of both seeds and write one report of verdicts"),
]
