"""Built-in corpus `stdlib-prose`: the English of the standard library, its docstrings and comments.

One document per `stdlib` source file, made of that file's module, class and function docstrings
(found with `ast`) and its comments (whole-line comments, found with `tokenize`), in source order, one paragraph per
docstring or run of comment lines. Files with fewer than `MIN_PROSE_CHARS` characters of prose
give no document. The document keeps its file's key, the relative path, so `stdlib` and
`stdlib-prose` hold out the same files for validation.

Left out: the shebang and encoding lines, tool pragmas (``# noqa``, ``# type: ...``,
``# pragma: ...``, ``# fmt: ...``) and comment lines without a letter (rules like ``# ----``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from ropelab.data.corpus import stdlib_text

MIN_PROSE_CHARS = 200
EXTRACTION = "1"  # changes whenever the rules above do: the token cache is keyed by it
_HEADER = re.compile(r"^(!|.*?coding[:=])")  # a shebang or encoding line: on line 1 or 2 only
_PRAGMA = re.compile(r"^(noqa\b|type:|pragma:|fmt:)")
_LETTER = re.compile(r"[^\W\d_]")


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, cleaned docstring) of the module and of every class and function."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text and text.strip():
                found.append((node.body[0].lineno, text.strip()))
    return found


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every run of whole-line comments on consecutive lines, the '#' taken off
    (a comment after code on its line annotates that code, e.g. the rows of a codec's table: left out)."""
    blocks: list[tuple[int, list[str]]] = []
    last_row = -2
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT or not token.line.lstrip().startswith("#"):
            continue
        text = token.string.lstrip("#").strip()
        row = token.start[0]
        if not _LETTER.search(text) or _PRAGMA.match(text) or (row <= 2 and _HEADER.match(text)):
            continue
        if row == last_row + 1 and blocks:
            blocks[-1][1].append(text)
        else:
            blocks.append((row, [text]))
        last_row = row
    return [(row, "\n".join(lines)) for row, lines in blocks]


def source_prose(source: str) -> str:
    """The docstrings and comments of Python source text, in source order, blank-line separated;
    empty when the source does not parse or holds fewer than `MIN_PROSE_CHARS` characters of prose."""
    try:
        pieces = _docstrings(ast.parse(source)) + _comment_blocks(source)
    except (SyntaxError, ValueError, tokenize.TokenError):  # ValueError: a NUL byte in the source
        return ""
    text = "\n\n".join(piece for _, piece in sorted(pieces, key=lambda piece: piece[0]))
    return text if len(text) >= MIN_PROSE_CHARS else ""


def stdlib_prose(path: Path) -> str:
    """The `stdlib-prose` document of one standard-library file ('' when it gives none)."""
    return source_prose(stdlib_text(path))
