"""Folders written by `ropelab import`: another framework's model as a ropelab run directory.

  import_model(source, out_dir)   a Hugging Face folder or hub name (one ropelab exported too), or a
                                  GGUF file (or a built-in name such as ``smollm2-135m``) -> `out_dir`:
                                  config.yaml, a step-0 checkpoint, import.json (where the weights came
                                  from) and, for GGUF, the model's tokenizer.json; every command then
                                  takes `out_dir`
  write_imported(model, ...)      the same folder for a model already in memory
  save_weights_only(...)          a complete checkpoint of weights with a fresh optimizer

The folder is built under a temporary name and renamed into place when complete
(`ropelab.files.new_folder`), so a failure never leaves half of one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import yaml

from ropelab.config import ConfigError, DataConfig, ModelConfig, RunConfig, build_run_config
from ropelab.data.tokenizer import HFTokenizer
from ropelab.files import new_folder, refuse_existing
from ropelab.model import Transformer
from ropelab.sources import hf_models
from ropelab.sources.locate import resolve
from ropelab.sources.runs import CONFIG, IMPORT
from ropelab.train import checkpoint as ckpt
from ropelab.train.optim import build_optimizer

TOKENIZER = "tokenizer.json"
DEFAULT_SEQ_LEN = 256


def save_weights_only(run_dir: Path, step: int, model: Transformer, config: RunConfig) -> Path:
    """A complete checkpoint `run_dir/checkpoints/step_<step>/` (save_checkpoint's layout and marker)
    holding `model`'s weights, a fresh optimizer state and the RNG state, so a resumed training run
    would start from these weights at `step`."""
    extra = {"data": {"seed": config.seed, "next_step": step}}
    return ckpt.save_checkpoint(run_dir, step, model, build_optimizer(model, config.train), extra, keep=1)


def converted_run_config(model: ModelConfig, tokenizer_spec: str) -> RunConfig:
    """The run configuration of a model made elsewhere: its own model settings, its tokenizer, and a
    CPU-sized default training length (a fine-tune sets its own)."""
    seq_len = min(DEFAULT_SEQ_LEN, model.max_seq_len)
    return RunConfig(model=model, data=DataConfig(tokenizer=tokenizer_spec, seq_len=seq_len))


def write_imported(model: Transformer, out_dir: str | Path, tokenizer_spec: str, record: dict,
                   tokenizer: Optional[HFTokenizer] = None, files: Optional[dict[str, bytes]] = None) -> Path:
    """`out_dir` as a run directory holding `model` at step 0. `tokenizer`, when given, is saved as
    `out_dir/tokenizer.json` and becomes data.tokenizer (`tokenizer_spec` is then ignored). `files`
    ({name: content}) are written beside them, inside the same all-or-nothing folder."""
    out = refuse_existing(out_dir)
    with new_folder(out) as tmp:
        for name, content in (files or {}).items():
            (tmp / name).write_bytes(content)
        spec = TOKENIZER if tokenizer is not None else tokenizer_spec  # relative: the folder may move
        if tokenizer is not None:
            tokenizer.tok.save(str(tmp / TOKENIZER))
        config = build_run_config(yaml.safe_load(converted_run_config(model.config, spec).to_yaml()))  # validated, as loading reads it
        (tmp / CONFIG).write_text(config.to_yaml())
        save_weights_only(tmp, 0, model, config)
        (tmp / IMPORT).write_text(json.dumps(record, indent=2))
    return out / "checkpoints" / ckpt.step_dir(out, 0).name


def import_model(source: str, out_dir: str | Path, trust_remote_code: bool = False) -> dict:
    """Convert a Llama/Qwen2/Qwen3/GPT-NeoX causal LM (hub name, HF folder, GGUF file or built-in name),
    or a folder ropelab exported with its own modeling code, into a ropelab folder `out_dir` that every
    command reads. `trust_remote_code` lets transformers run code shipped with an HF model.

    Returns a summary: out_dir, source, architecture, checkpoint, params, tokenizer. Raises ConfigError
    (one line) when the model cannot be loaded or has no exact ropelab equivalent; nothing is written then."""
    out = refuse_existing(out_dir)
    found = resolve(source, trust_remote_code)
    if found.kind not in ("hf", "export", "gguf"):
        raise ConfigError(f"{source}: already a ropelab {found.kind}; nothing to import (every command takes it as it is)")
    converted = hf_models.convert(found)
    record = {"source": found.location, "kind": found.kind, "architecture": converted.architecture,
              "transformers": converted.transformers_version, "tokenizer": converted.tokenizer_note}
    folder = write_imported(converted.model, out, converted.tokenizer_spec, record, converted.tokenizer)
    return {
        "out_dir": str(out), "source": source, "architecture": converted.architecture,
        "checkpoint": str(folder), "params": converted.model.num_params(), "tokenizer": converted.tokenizer_note,
    }
