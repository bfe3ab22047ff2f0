"""YAML as ropelab reads it, everywhere (run configs, study and claims files, the config.yaml of a run
and the study.yaml of a study): PyYAML's safe loader, refusing what would be silently wrong or
unbounded instead of guessing:

  * a key given twice in one mapping, at any level (YAML keeps the last one without a word: a second
    ``train:`` block would replace the first);
  * aliases standing for more than `MAX_ALIAS_NODES` nodes (a "billion laughs" file of a few hundred
    bytes expands to gigabytes wherever the value is copied or printed), and an alias inside the node
    it names (a structure that contains itself);
  * nesting deeper than `MAX_DEPTH` levels (PyYAML composes nodes recursively: a few hundred levels
    overflow Python's stack).

Merge keys (``<<: *defaults``) still work: the keys they bring in may repeat the mapping's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ropelab.errors import QUOTE_LIMIT, ConfigError, bounded, quoted

MAX_DEPTH = 64
MAX_ALIAS_NODES = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLRefused(yaml.MarkedYAMLError):
    """Valid YAML that ropelab refuses to read: a repeated key, an alias expanding too far, nesting
    too deep. `problem` says which, `problem_mark` where."""

    def __init__(self, problem: str, mark: yaml.Mark):
        super().__init__(problem=problem, problem_mark=mark)


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with the refusals of this module, made while the document is composed."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.path: list[Optional[str | int]] = []  # key or index of each node being composed, outermost first
        self.open_anchors: set[str] = set()  # anchors of the nodes being composed
        self.expanded: dict[int, int] = {}  # id(node) -> nodes it stands for with its aliases expanded
        self.alias_nodes = 0  # nodes the aliases read so far stand for

    def compose_node(self, parent: Optional[Node], index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            return self.compose_alias(parent, index, event)
        if len(self.path) >= MAX_DEPTH:
            raise YAMLRefused(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        if isinstance(index, ScalarNode):
            self.path.append(index.value)
        else:
            self.path.append(index if isinstance(index, int) else None)
        if event.anchor is not None:
            self.open_anchors.add(event.anchor)
        node = super().compose_node(parent, index)
        self.open_anchors.discard(event.anchor)
        if isinstance(node, MappingNode):
            self.refuse_repeated_keys(node)
        children = [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else (
            node.value if isinstance(node, SequenceNode) else [])
        self.expanded[id(node)] = 1 + sum(self.expanded[id(child)] for child in children)
        self.path.pop()
        return node

    def compose_alias(self, parent: Optional[Node], index: Any, event: yaml.AliasEvent) -> Node:
        if event.anchor in self.open_anchors:
            raise YAMLRefused(f"alias *{bounded(event.anchor, QUOTE_LIMIT)} is inside the node it names "
                              "(a structure that contains itself)", event.start_mark)
        node = super().compose_node(parent, index)  # an undefined anchor is PyYAML's ComposerError
        self.alias_nodes += self.expanded[id(node)]
        if self.alias_nodes > MAX_ALIAS_NODES:
            raise YAMLRefused(f"aliases expand to more than {MAX_ALIAS_NODES:,} nodes (at *{bounded(event.anchor, QUOTE_LIMIT)}); "
                              "write the values out instead", event.start_mark)
        return node

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """PyYAML's, with a scalar its tag cannot make (``2024-13-45`` read as a date, ``!!int x``) a
        ConstructorError at its line instead of the ValueError or AttributeError of the conversion."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, AttributeError, OverflowError):
            raise yaml.constructor.ConstructorError(
                None, None, f"{quoted(node.value)} is not a valid {node.tag.rsplit(':', 1)[-1]}", node.start_mark) from None

    def refuse_repeated_keys(self, node: MappingNode) -> None:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                continue  # a mapping or list as a key is PyYAML's "unhashable key"
            key = self.construct_object(key_node)
            if key in first_line:
                raise YAMLRefused(f"key {self.dotted(key)} is given twice (first at line {first_line[key]}); "
                                  "each key may appear once", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1

    def dotted(self, key: Any) -> str:
        """The key's place in the document: ``train.phases[1].steps``."""
        text = ""
        for part in [*self.path, str(key)]:
            if isinstance(part, int):
                text += f"[{part}]"
            elif part is not None:
                text += f".{part}" if text else part
        return bounded(text, QUOTE_LIMIT)


def parse_yaml(text: str) -> Any:
    """The YAML document in `text`; a `yaml.YAMLError` (`YAMLRefused` for this module's refusals)."""
    loader = StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """The YAML document in file `path`; a one-line ConfigError naming the file (and line) when it is not
    readable UTF-8 YAML or is refused (`parse_yaml`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; expected a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        return parse_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path} (line {mark.line + 1})" if mark else str(path)
        if isinstance(exc, YAMLRefused):
            raise ConfigError(f"{where}: {exc.problem}") from None
        problem = f" ({bounded(exc.problem, QUOTE_LIMIT)})" if getattr(exc, "problem", None) else ""
        raise ConfigError(f"{where}: not valid YAML{problem}") from None


def load_yaml(path: str | Path) -> dict:
    """A YAML config file: a mapping of config keys (`read_yaml`'s refusals; {} for an empty file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    data = read_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys")
    return data
