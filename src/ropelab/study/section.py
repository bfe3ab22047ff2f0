"""One optional section of a study report, and the tables sections are made of."""

from __future__ import annotations

import html
from dataclasses import dataclass, field


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
