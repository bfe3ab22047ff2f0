"""A validated `RunConfig` from defaults, a model preset, a YAML file's dict and dotted overrides
(``model.rope.fraction=0.25``): `build_run_config`, and the override parsing it uses."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import yaml

from ropelab.config.coerce import from_dict
from ropelab.config.model import ModelConfig
from ropelab.config.run import RunConfig
from ropelab.config.yaml_files import YAMLRefused, parse_yaml
from ropelab.errors import ConfigError, quoted


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.rope.fraction=0.25"`` -> ``("model.rope.fraction", 0.25)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {quoted(text)}: expected key=value, e.g. model.rope.fraction=0.25")
    key, raw = text.split("=", 1)
    try:
        value = parse_yaml(raw) if raw != "" else ""
    except YAMLRefused as exc:
        raise ConfigError(f"{key.strip()}: {exc.problem}") from None
    except yaml.YAMLError:  # not YAML: the text as it is
        value = raw
    return key.strip(), value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict; ``name[i]`` addresses item i of a list (e.g.
    ``train.phases[1].overrides.model.rope.theta``, with the rest taken as one dotted key)."""
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        match = re.fullmatch(r"(\w+)\[(\d+)\]", part)
        if match:
            items = node.get(match.group(1))
            index = int(match.group(2))
            if not isinstance(items, list) or index >= len(items) or not isinstance(items[index], dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: no such list item, cannot set {key}")
            node = items[index]
            if parts[i + 1] == "overrides":  # phase overrides hold dotted keys as they are
                node.setdefault("overrides", {})[".".join(parts[i + 2 :])] = value
                return
            continue
        child = node.get(part)
        if not isinstance(child, dict):
            if part in node and child is not None:
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set {key}")
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def build_run_config(
    base: dict | None = None, preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Merge defaults < model preset < YAML dict < dotted overrides, then validate."""
    tree = copy.deepcopy(base) if base else {}
    preset = preset or tree.pop("preset", None)
    for text in overrides:
        key, value = parse_override(text)
        if key == "preset":
            preset = value
            continue
        set_dotted(tree, key, value)
    model_tree = tree.pop("model", {}) or {}
    if not isinstance(model_tree, dict):
        raise ConfigError("model: expected a mapping of model keys")
    model_preset = model_tree.pop("preset", None) or preset or "tiny-llama"
    model_dict = dataclasses.asdict(ModelConfig.from_name(model_preset))
    for key, value in model_tree.items():
        if key == "rope" and isinstance(value, dict):
            model_dict["rope"] = model_dict["rope"] | value
        else:
            model_dict[key] = value
    tree["model"] = model_dict
    return from_dict(RunConfig, tree).validate()
