"""Typed configuration: dataclasses, named model presets, YAML and dotted overrides.

Every component owns a small dataclass; `RunConfig` gathers them. Loading goes through `from_dict`,
which rejects unknown keys and wrong types with a `ConfigError` naming the dotted key, so a user
mistake never becomes a traceback. Importing this package does not import torch.

  rope.py     RopeConfig, RopeScalingConfig: how a layer rotates queries and keys
  model.py    ModelConfig and the named presets (MODEL_PRESETS)
  layout.py   LayerKind, QueryTemperature: a layer kind's RoPE, attention window and query temperature
  run.py      DataConfig, AttentionConfig, PhaseConfig, TrainConfig, DistillConfig, RunConfig
  checks.py   range checks of numeric settings, shared by the `validate` methods
  coerce.py   from_dict: a dataclass from a plain dict, keys and types checked
  build.py    build_run_config: defaults < preset < YAML < dotted overrides, validated
  yaml_files.py  load_yaml, read_yaml, parse_yaml: every YAML ropelab reads, refusing repeated keys,
              alias bombs and deep nesting in one line
"""

from ropelab.config.build import build_run_config, parse_override, set_dotted
from ropelab.config.coerce import from_dict
from ropelab.config.layout import LayerKind, QueryTemperature
from ropelab.config.model import MODEL_PRESETS, ModelConfig
from ropelab.config.rope import PLAN_KEYS, SCALING_METHODS, RopeConfig, RopeScalingConfig, resolve_rotary_dims
from ropelab.config.run import AttentionConfig, DataConfig, DistillConfig, PhaseConfig, RunConfig, TrainConfig
from ropelab.config.yaml_files import load_yaml, parse_yaml, read_yaml
from ropelab.errors import ConfigError

__all__ = [
    "AttentionConfig", "ConfigError", "DataConfig", "DistillConfig", "LayerKind", "MODEL_PRESETS", "ModelConfig", "PLAN_KEYS",
    "PhaseConfig", "QueryTemperature", "RopeConfig", "RopeScalingConfig", "RunConfig", "SCALING_METHODS", "TrainConfig",
    "build_run_config", "from_dict", "load_yaml", "parse_override", "parse_yaml", "read_yaml", "resolve_rotary_dims",
    "set_dotted",
]
