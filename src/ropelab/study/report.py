"""Study report: summarise every run of a study and write tables, plots and text.

Written by `write_report` (into `study_dir` unless `out_dir` is given): summary.csv,
summary.json, loss_curves.png, final_loss.png, report.md and a self-contained report.html.

Reading the runs lives in `ropelab.study.run_folders`, the per-run summary in `ropelab.study.summary`,
the figures in `ropelab.study.plots`. Command line: ``ropelab report STUDY_DIR``.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.study.frontier import read_study_record
from ropelab.study.plots import BAND_CMAPS, plot_final_loss, plot_loss_curves
from ropelab.study.run_folders import collect_runs
from ropelab.study.sections import Section, report_sections
from ropelab.study.summary import COLUMNS, findings, summarize

__all__ = ["write_report", "render_markdown", "render_html"]


# ------------------------------------------------------------------------------- text


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "—"
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    return str(v)



TABLE_COLUMNS = [
    ("id", "run"), ("status", "status"), ("group", "group"), ("fraction_label", "RoPE"), ("fraction", "fraction"),
    ("rotary_dims", "rot. dims"), ("seed", "seed"), ("final_train_loss", "train loss"),
    ("final_val_loss", "val loss"), ("band", "band"), ("spikes", "spikes"), ("unrecovered_spikes", "unrec."),
    ("steps_to_target", "steps→target"), ("tokens", "tokens"), ("tokens_per_s", "tok/s"), ("wall_time_s", "wall s"),
]


def _table_columns(rows: list[dict]) -> list[tuple[str, str]]:
    cols = TABLE_COLUMNS
    if len({r["group"] for r in rows}) <= 1:
        cols = [c for c in cols if c[0] != "group"]
    return cols


def _cell(row: dict, key: str) -> str:
    v = row[key]
    if key == "fraction" and v is not None:
        return f"{v:.3f}"
    if key in ("final_train_loss", "final_val_loss") and v is not None:
        return f"{v:.4f}"
    if key in ("tokens_per_s", "wall_time_s") and v is not None:
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return _fmt(v)


def render_markdown(rows: list[dict], sections: list[Section] = (), title: str = "Partial-RoPE study report") -> str:
    cols = _table_columns(rows)
    lines = [f"# {title}", ""]
    lines += [f"- {s}" for s in findings(rows)]
    lines += ["", "![loss curves](loss_curves.png)", "", "![final loss vs fraction](final_loss.png)", "",
              "| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, k).replace("|", "\\|") for k, _ in cols) + " |")
    lines += ["", f"Final loss = mean training loss over the last {rows[0]['_study']['tail_fraction']:.0%} of steps"
              if rows else "", ""]
    for section in sections:
        lines += [f"## {section.title}", "", section.markdown, ""]
    return "\n".join(lines)


def _inline(text: str) -> str:
    """HTML of a findings sentence: escaped, with `code` spans."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def figure_html(name: str, data: bytes) -> str:
    return (f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
            f"<figcaption>{html.escape(name)}</figcaption></figure>")


def render_html(rows: list[dict], images: dict[str, bytes], sections: list[Section] = (),
                title: str = "Partial-RoPE study report") -> str:
    from matplotlib import colormaps

    cols = _table_columns(rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in cols)
    body = []
    for row in rows:
        cells = []
        for key, _ in cols:
            style = ""
            if key == "band" and row["band"] is not None:
                r, g, b, _a = colormaps[BAND_CMAPS[row["band"] % len(BAND_CMAPS)]](0.35)
                style = f' style="background: rgb({r * 255:.0f},{g * 255:.0f},{b * 255:.0f})"'
            if key == "status" and row["status"] != "done":
                style = ' class="bad"'
            if key == "unrecovered_spikes" and row[key]:
                style = ' class="bad"'
            cells.append(f"<td{style}>{html.escape(_cell(row, key))}</td>")
        title = f' title="{html.escape(row["error"])}"' if row["error"] else ""
        body.append(f"<tr{title}>{''.join(cells)}</tr>")
    bullets = "".join(f"<li>{_inline(s)}</li>" for s in findings(rows))
    figs = "".join(figure_html(name, data) for name, data in images.items())
    extra = "".join(f"<h2>{html.escape(s.title)}</h2>{''.join(figure_html(n, d) for n, d in s.images.items())}{s.html}"
                    for s in sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1400px;
       color: #222; padding: 0 1em; line-height: 1.45; }}
h1 {{ font-size: 1.5em; }} h2 {{ font-size: 1.2em; margin-top: 2em; }} pre {{ font-size: .8em; }} code {{ background: #f2f2f2; padding: 0 .25em; border-radius: 3px; }}
figure {{ margin: 1.5em 0; }} figure img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ color: #666; font-size: .85em; }}
table {{ border-collapse: collapse; font-size: .85em; margin-top: 1em; }}
th, td {{ border: 1px solid #ccc; padding: .3em .6em; text-align: right; white-space: nowrap; }}
th {{ background: #333; color: #fff; position: sticky; top: 0; }}
td:first-child, th:first-child {{ text-align: left; }}
tr:nth-child(even) td {{ background-color: #fafafa; }}
td.bad {{ color: #b00; font-weight: 600; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{bullets}</ul>
{figs}
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(body)}
</tbody></table>
{extra}
</body></html>
"""


# ------------------------------------------------------------------------------ write


def json_safe(v: Any) -> Any:
    """`v` with non-finite floats as None and numpy scalars as Python numbers (strict JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, np.generic):
        return json_safe(v.item())
    return v


def _study_title(study_dir: Path) -> str:
    name = read_study_record(study_dir).get("name")
    return f"Study report: {name}" if name else "Partial-RoPE study report"


def write_report(
    study_dir: str | Path, target: Optional[float] = None, out_dir: str | Path | None = None
) -> dict[str, Path]:
    """Read ``study_dir/runs/*`` and write summary.csv, summary.json, loss_curves.png,
    final_loss.png, report.md and report.html into `out_dir` (default `study_dir`).
    Returns ``{file name: path}``. ConfigError for a folder that is not a study (no ``runs/``)."""
    if not (Path(study_dir) / "runs").is_dir():
        what = "no such folder" if not Path(study_dir).is_dir() else "not a study folder (no runs/ in it)"
        raise ConfigError(f"{study_dir}: {what}; give the folder `ropelab study --out` wrote")
    runs = collect_runs(study_dir)  # the run folders and study.yaml are checked before anything is written
    title = _study_title(Path(study_dir))
    rows = summarize(runs, target=target)
    out = Path(out_dir) if out_dir is not None else Path(study_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in
             ("summary.csv", "summary.json", "loss_curves.png", "final_loss.png", "report.md", "report.html")}

    with open(paths["summary.csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row[k] is None else (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k]))
                             for k in COLUMNS})
    study = rows[0]["_study"] if rows else {}
    payload = {"study": study, "runs": [{k: v for k, v in row.items() if k != "_study"} for row in rows]}
    paths["summary.json"].write_text(json.dumps(json_safe(payload), indent=2) + "\n")

    images = {"loss_curves.png": plot_loss_curves(rows, runs), "final_loss.png": plot_final_loss(rows)}
    for name, data in images.items():
        paths[name].write_bytes(data)
    sections = report_sections(study_dir)
    for section in sections:  # report.md links them; a section that reads a results folder finds them there already
        for name, data in section.images.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
    paths["report.md"].write_text(render_markdown(rows, sections, title))
    paths["report.html"].write_text(render_html(rows, images, sections, title))
    return paths
