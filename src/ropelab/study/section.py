"""One optional section of a study report, and the tables sections are made of."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

LONGCTX_DIR = "longctx"  # the study folder's long-context evaluation (`ropelab.study.sections`), read by other sections


@dataclass
class Section:
    title: str
    markdown: str
    html: str
    images: dict[str, bytes] = field(default_factory=dict)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def folder_section(title: str, study_dir: Path, folder: str, markdown_name: str, image_names: tuple[str, ...]) -> Section | None:
    """A section from a results folder of the study (e.g. ``longctx/``): its markdown without the title
    line, after the folder's figures; None when the folder holds no such markdown."""
    where = study_dir / folder
    if not (where / markdown_name).is_file():
        return None
    text = (where / markdown_name).read_text()
    images = {f"{folder}/{name}": (where / name).read_bytes() for name in image_names if (where / name).is_file()}
    body = text.split("\n", 1)[1] if text.startswith("# ") else text  # the report gives the title
    figures = "\n\n".join(f"![{name}]({name})" for name in images)
    return Section(title, f"{figures}\n\n{body}", f"<pre>{html.escape(body)}</pre>", images)
