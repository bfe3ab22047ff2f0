"""The guide (docs/, mkdocs.yml) and the README stay true: the site builds with `mkdocs build --strict`,
every `ropelab` command they show is one the command line accepts, and every file they name exists."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ropelab.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w-]*)")
NOT_SHELL = {"yaml", "yml", "python", "json", "text", "toml"}
INLINE_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
# a file or folder of the repository named in the text: configs/tiny.yaml, configs/paper/kd-*.yaml, benchmarks/rope.py
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:configs|benchmarks|scripts|tests)/[\w./*-]*[\w*/])")
LOCAL_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# The set-up commands create .venv without activating it: an example that runs `ropelab` (or
# `torchrun -m ropelab`) from PATH fails with "command not found" unless the reader was told this first.
ACTIVATE = "source .venv/bin/activate"


def fenced_command_lines(text: str) -> list[tuple[int, str]]:
    """The command lines of a page's fenced shell blocks (console blocks: the `$ ` lines only, backslash
    continuations joined), each with the offset in `text` of the line it starts on."""
    lines, block, language, pending, start, offset = [], False, "", "", 0, 0
    for raw in text.splitlines(keepends=True):
        at, offset = offset, offset + len(raw)
        (line,) = raw.splitlines() or [""]
        fence = FENCE.match(line)
        if fence:
            block, language = not block, fence.group(2).lower()
            continue
        if not block or language in NOT_SHELL:
            continue
        if language == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        start = start if pending else at
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return lines


def shell_lines(text: str) -> list[str]:
    """The command lines of a page: those of its fenced shell blocks and inline code that starts with a
    command."""
    outside = re.sub(r"^\s*(```+|~~~+).*?^\s*\1", "", text, flags=re.S | re.M)
    return ([line for _, line in fenced_command_lines(text)]
            + [span for span in INLINE_CODE.findall(outside) if span.split()[:1] in (["ropelab"], ["torchrun"])])


def ropelab_invocations(line: str) -> list[tuple[str, list[str]]]:
    """(program, arguments) of each `ropelab` invocation in a shell line: `ropelab ...`,
    `.venv/bin/ropelab ...`, `torchrun ... -m ropelab ...` (program `ropelab`, the module), placeholders'
    brackets and `...` dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = [t.strip("[]") for t in lexer]
    segments, segment = [], []
    for token in tokens:
        if token in ("&&", "||", ";", "|", "&"):
            segments.append(segment)
            segment = []
        elif token not in ("", "..."):
            segment.append(token)
    segments.append(segment)
    commands = []
    for tokens in segments:
        for i, token in enumerate(tokens):
            program = token == "ropelab" or token.endswith("/ropelab")
            if program and (i == 0 or tokens[i - 1] == "-m" or all(re.match(r"\w+=", t) for t in tokens[:i])):
                commands.append((token, tokens[i + 1:]))
                break
    return [(program, args) for program, args in commands if args]


def documented_commands() -> list[tuple[str, list[str]]]:
    return [(f"{page.relative_to(ROOT)}: {line.strip()}", args)
            for page in PAGES for line in shell_lines(page.read_text()) for _, args in ropelab_invocations(line)]


def accepted_options(args: list[str]) -> tuple[set[str] | None, str]:
    """The options of the (sub)command `args` starts with, read from its `--help` as the CLI builds it;
    (None, the parser's message) when the command does not exist."""
    path = [args[0]] + ([args[1]] if len(args) > 1 and not args[1].startswith("-") else [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
        build_parser().parse_args([*path, "--help"])
    if stopped.value.code != 0:
        return None, err.getvalue().strip().splitlines()[-1]
    options = set()
    for line in out.getvalue().splitlines():
        if re.match(r"^  -", line):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            options.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", invocation))
    return options, ""


def test_the_guide_builds_with_mkdocs_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.is_file(), f"{mkdocs}: not installed; `pip install -e '.[dev]'` brings the docs extra"
    done = subprocess.run([str(mkdocs), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "index.html").read_text().count('class="doc doc-object') >= 10


def test_the_build_fails_on_broken_links_and_pages_left_out():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    assert {config["validation"]["links"][k] for k in ("not_found", "anchors", "unrecognized_links")} == {"warn"}


def test_every_documented_command_is_accepted():
    commands = documented_commands()
    assert len(commands) > 50, f"only {len(commands)} ropelab commands found in the docs and README"
    problems = []
    for where, args in commands:
        options, error = accepted_options(args)
        if options is None:
            problems.append(f"{where}\n    {error}")
            continue
        used = {a.split("=", 1)[0] for a in args if re.match(r"--?[A-Za-z]", a)}
        problems += [f"{where}\n    {flag}: not an option of `ropelab {' '.join(args[:2])}`" for flag in sorted(used - options)]
    assert not problems, "\n".join(problems)


def test_a_wrong_command_or_flag_is_caught():
    ((_, wrong_command),) = ropelab_invocations("ropelab trian --out runs/x")
    assert accepted_options(wrong_command)[0] is None
    ((_, args),) = ropelab_invocations("torchrun --nproc_per_node 2 -m ropelab eval longctx runs/a [RUN ...]")
    options, _ = accepted_options(args)
    assert "--lengths" in options and "--tasks" in options and "--jobs" not in options
    assert ropelab_invocations("ropelab-lm-eval --model ropelab --model_args pretrained=RUN") == []


def test_every_named_repository_path_exists():
    missing = []
    for page in PAGES:
        for name in sorted(set(REPO_PATH.findall(page.read_text()))):
            if not (list(ROOT.glob(name.rstrip("/"))) if "*" in name else (ROOT / name).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "named but missing:\n" + "\n".join(missing)


def test_the_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    links = [link for link in LOCAL_LINK.findall(readme) if "://" not in link]
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def guide_in_reading_order() -> list[Path]:
    """The guide's pages in the order of mkdocs.yml's nav."""
    def pages(nav) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        items = nav.values() if isinstance(nav, dict) else nav
        return [page for item in items for page in pages(item)]

    return [ROOT / "docs" / page for page in pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])]


def unprepared_examples(document: list[Path]) -> list[str]:
    """The pages of `document` (read in order) whose first example running `ropelab` from PATH comes
    before any page has said `ACTIVATE`, each with that example's line."""
    problems, told = [], False
    for page in document:
        text = page.read_text()
        told_at = text.find(ACTIVATE)
        first = next((at for at, line in fenced_command_lines(text)
                      if any(program == "ropelab" for program, _ in ropelab_invocations(line))), None)
        if first is not None and not told and not 0 <= told_at < first:
            line = text.count("\n", 0, first) + 1
            problems.append(f"{page.relative_to(ROOT)}:{line}")
        told = told or told_at >= 0
    return problems


def test_examples_calling_ropelab_from_path_come_after_the_activation():
    guide = guide_in_reading_order()
    assert ROOT / "docs" / "getting-started.md" in guide and len(guide) == len(PAGES) - 1
    problems = unprepared_examples([ROOT / "README.md"]) + unprepared_examples(guide)
    assert not problems, (f"examples run a bare `ropelab` before the reader is told `{ACTIVATE}` (the set-up "
                          f"does not activate .venv): {', '.join(problems)}")


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
