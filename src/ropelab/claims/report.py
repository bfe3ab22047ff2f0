"""The claims report of `ropelab claims`: claims.html (one self-contained page), claims.md with its
figures under claims_files/, and claims.json.

Each opens with the verdict table (one row per claim, linked to the claim's section), then states
the verdict rule and the run's `meta`, then gives each claim its section. Everything is rendered
before anything is written, and each file is written atomically, so a failure leaves the previous
report as it was.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ropelab.claims.claim import Claim, Finding
from ropelab.claims.verdict import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, rule_text
from ropelab.config import ConfigError
from ropelab.files import write_atomically
from ropelab.study.report import figure_html, json_safe
from ropelab.study.section import html_table, markdown_table

__all__ = ["write_claims_report"]

Entries = list[tuple[Claim, Finding]]

TITLE = "The seeds' claims, tested at tiny scale"
FIGURES = "claims_files"
VERDICT_CLASS = {HOLDS: "holds", DOES_NOT_HOLD: "fails", INCONCLUSIVE: "open"}
VERDICT_HEADER = ["claim", "seed", "section", "statement", "regime (here / the seed's)", "verdict", "decided by"]
STUDY_COLUMNS = ["name", "runs", "tokens", "seconds", "status"]
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
SHORT = 140  # characters of a statement in the verdict table


# ------------------------------------------------------------------ text shared by both renderings


def anchor(claim: Claim) -> str:
    return f"claim-{claim.id}"


def figure_path(claim: Claim) -> str:
    """Where the markdown finds the claim's figure, relative to claims.md."""
    return f"{FIGURES}/{claim.id}.png"


def _short(text: str, limit: int = SHORT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _deciding(finding: Finding) -> str:
    """The figures that decided the verdict (its reason), shortened for the verdict table."""
    return _short(finding.verdict.reason, 2 * SHORT)


def regime_text(claim: Claim, finding: Finding) -> str:
    return f"{finding.regime or 'not stated'} / {claim.seed_regime or 'not stated'}"


def _tally(entries: Entries) -> str:
    counts = Counter(finding.verdict.outcome for _, finding in entries)
    return f"{len(entries)} claims: " + ", ".join(f"{counts[o]} {o}" for o in VERDICT_CLASS)


def _meta_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(json_safe(value), default=str)


def _study_cell(study: dict, key: str) -> str:
    value = study.get(key)
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "—" if value is None else str(value)


def _study_rows(meta: dict) -> list[list[str]]:
    return [[_study_cell(study, key) for key in STUDY_COLUMNS] for study in meta.get("studies", [])]


def _other_meta(meta: dict) -> dict[str, str]:
    return {key: _meta_value(value) for key, value in meta.items() if key not in ("machine", "command", "studies")}


def _check(entries: Entries) -> None:
    ids = [claim.id for claim, _ in entries]
    for claim_id in ids:
        if not ID.fullmatch(claim_id):
            raise ConfigError(f"claims report: claim id {claim_id!r} is not letters, digits, '-' and '_'")
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    if repeated:
        raise ConfigError(f"claims report: claim id {repeated[0]!r} is given twice")


# ------------------------------------------------------------------ markdown


def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    return markdown_table([_md_cell(h) for h in header], [[_md_cell(c) for c in row] for row in rows])


def _md_claim(claim: Claim, finding: Finding) -> list[str]:
    verdict = finding.verdict
    lines = [f'<a id="{anchor(claim)}"></a>', "", f"## {claim.id}: {' '.join(claim.statement.split())}", "",
             f"- seed: {claim.seed}", f"- section: {claim.section}", f"- studies: {', '.join(claim.studies)}",
             f"- regime (here / the seed's): {regime_text(claim, finding)}", "",
             "**Measured.** " + finding.measured.strip(), "",
             f"**Verdict: {verdict.outcome}.** {verdict.reason}", ""]
    if finding.figure is not None:
        lines += [f"![{_md_cell(finding.figure_caption or claim.id)}]({figure_path(claim)})", ""]
        if finding.figure_caption:
            lines += [f"*{finding.figure_caption.strip()}*", ""]
    if finding.table is not None:
        lines += [_md_table(*finding.table), ""]
    if finding.note:
        lines += ["**Note.** " + finding.note.strip(), ""]
    return lines + ["[back to the verdicts](#verdicts)", ""]


def render_markdown(entries: Entries, meta: dict) -> str:
    verdicts = [[f"[{claim.id}](#{anchor(claim)})", claim.seed, claim.section, _short(claim.statement),
                 regime_text(claim, finding), f"**{finding.verdict.outcome}**", _deciding(finding)] for claim, finding in entries]
    lines = [f"# {TITLE}", "", '<a id="verdicts"></a>', "", _md_table(VERDICT_HEADER, verdicts), "", _tally(entries), "",
             "## How a verdict is decided", "", rule_text(), "", "## The run", ""]
    if "machine" in meta:
        lines += [f"- machine: {meta['machine']}"]
    if "command" in meta:
        lines += [f"- command: `{meta['command']}`"]
    lines += [f"- {key}: {value}" for key, value in _other_meta(meta).items()]
    if meta.get("studies"):
        lines += ["", _md_table(STUDY_COLUMNS, _study_rows(meta))]
    lines.append("")
    for claim, finding in entries:
        lines += _md_claim(claim, finding)
    return "\n".join(lines)


# ------------------------------------------------------------------ html

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; padding: 0 1em; line-height: 1.45; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2.2em; } h3 { font-size: 1em; margin-bottom: .3em; }
code { background: #f2f2f2; padding: 0 .25em; border-radius: 3px; overflow-wrap: anywhere; }
.text { white-space: pre-line; margin-top: .3em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #666; font-size: .85em; }
table { border-collapse: collapse; font-size: .85em; margin-top: 1em; }
caption { caption-side: bottom; text-align: left; color: #666; padding-top: .4em; }
th, td { border: 1px solid #ccc; padding: .3em .6em; text-align: left; vertical-align: top; overflow-wrap: anywhere; }
th { background: #333; color: #fff; white-space: nowrap; }
#verdicts td:first-child { white-space: nowrap; }
tr:nth-child(even) td { background-color: #fafafa; }
.verdict { font-weight: 600; padding: 0 .35em; border-radius: 3px; white-space: nowrap; }
.holds { color: #0b5d1e; background: #d8f3dc; } .fails { color: #8b0000; background: #fbd5d5; }
.open { color: #6b4e00; background: #fcebb6; }
.note { color: #555; font-size: .9em; }
dt { font-weight: 600; } dd { margin: 0 0 .4em 1.5em; }
"""


def _verdict_span(outcome: str) -> str:
    return f'<span class="verdict {VERDICT_CLASS.get(outcome, "open")}">{html.escape(outcome)}</span>'


def _verdict_table(entries: Entries) -> str:
    rows = []
    for claim, finding in entries:
        cells = [f'<a href="#{anchor(claim)}">{html.escape(claim.id)}</a>', html.escape(claim.seed),
                 html.escape(claim.section), html.escape(_short(claim.statement)), html.escape(regime_text(claim, finding)),
                 _verdict_span(finding.verdict.outcome), html.escape(_deciding(finding))]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in VERDICT_HEADER)
    return (f'<table id="verdicts"><caption>{html.escape(_tally(entries))}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _html_meta(meta: dict) -> str:
    parts = []
    if "machine" in meta:
        parts.append(f"<p>Machine: {html.escape(str(meta['machine']))}</p>")
    if "command" in meta:
        parts.append(f"<p>Command: <code>{html.escape(str(meta['command']))}</code></p>")
    if meta.get("studies"):
        parts.append(html_table(STUDY_COLUMNS, _study_rows(meta)))
    other = _other_meta(meta)
    if other:
        parts.append("<dl>" + "".join(f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(v)}</dd>" for k, v in other.items())
                     + "</dl>")
    return "".join(parts)


def _html_claim(claim: Claim, finding: Finding) -> str:
    verdict = finding.verdict
    parts = [f'<section id="{anchor(claim)}"><h2>{html.escape(claim.id)}: {html.escape(claim.statement)}</h2>',
             f"<p>{html.escape(claim.seed)}, {html.escape(claim.section)}; studies: "
             f"{', '.join(f'<code>{html.escape(s)}</code>' for s in claim.studies)}; regime (here / the seed's): "
             f"{html.escape(regime_text(claim, finding))}</p>",
             f'<h3>Measured</h3><p class="text">{html.escape(finding.measured.strip())}</p>',
             f'<h3>Verdict: {_verdict_span(verdict.outcome)}</h3><p class="text">{html.escape(verdict.reason)}</p>']
    if finding.figure is not None:
        parts.append(figure_html(finding.figure_caption or claim.id, finding.figure))
    if finding.table is not None:
        parts.append(html_table(*finding.table))
    if finding.note:
        parts.append(f'<p class="note text">Note: {html.escape(finding.note.strip())}</p>')
    return "".join(parts) + '<p><a href="#verdicts">back to the verdicts</a></p></section>'


def render_html(entries: Entries, meta: dict) -> str:
    claims = "\n".join(_html_claim(claim, finding) for claim, finding in entries)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(TITLE)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(TITLE)}</h1>
{_verdict_table(entries)}
<h2>How a verdict is decided</h2><p>{html.escape(rule_text())}</p>
<h2>The run</h2>{_html_meta(meta)}
{claims}
</body></html>
"""


# ------------------------------------------------------------------ json and files


def render_json(entries: Entries, meta: dict) -> str:
    claims = [{"id": claim.id, "seed": claim.seed, "section": claim.section, "statement": claim.statement,
               "studies": list(claim.studies), "measured": finding.measured, "verdict": finding.verdict.outcome,
               "reason": finding.verdict.reason, "regime": finding.regime, "seed_regime": claim.seed_regime,
               "table": None if finding.table is None else {"header": finding.table[0], "rows": finding.table[1]},
               "note": finding.note, "figure": None if finding.figure is None else figure_path(claim),
               "figure_caption": finding.figure_caption}
              for claim, finding in entries]
    return json.dumps(json_safe({"meta": meta, "rule": rule_text(), "claims": claims}), indent=2, default=str) + "\n"


def write_claims_report(out_dir: str | Path, entries: Entries, meta: dict) -> dict[str, Path]:
    """Write claims.html, claims.md (figures under claims_files/) and claims.json into `out_dir`;
    returns {file name relative to `out_dir`: path}."""
    _check(entries)
    contents: dict[str, str | bytes] = {figure_path(claim): finding.figure for claim, finding in entries
                                        if finding.figure is not None}
    contents["claims.json"] = render_json(entries, meta)
    contents["claims.md"] = render_markdown(entries, meta)
    contents["claims.html"] = render_html(entries, meta)
    paths = {name: Path(out_dir) / name for name in contents}
    for name, data in contents.items():
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        write_atomically(paths[name], data)
    return paths
