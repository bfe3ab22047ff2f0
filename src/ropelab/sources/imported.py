"""Folders written by `ropelab import` (`ropelab.sources.loading.import_model`): another framework's
model as a ropelab run directory: config.yaml, a step-0 checkpoint, import.json (where the weights
came from) and the model's tokenizer.json (unless it reads bytes), which config.yaml names relatively, so
the folder works moved and without its source; every command then takes the folder.

  write_converted(converted, out_dir, source, kind)
                                  the folder of a model converted from a source
  write_imported(model, ...)      the same folder for any model in memory, with its own record
  save_weights_only(...)          a complete checkpoint of weights with a fresh optimizer
  converted_run_config(model, tokenizer_spec)
                                  the run configuration such a folder holds

The folder is built under a temporary name and renamed into place when complete
(`ropelab.files.new_folder`), so a failure never leaves half of one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ropelab.config import DataConfig, ModelConfig, RunConfig, build_run_config, parse_yaml
from ropelab.data.tokenizer import HFTokenizer
from ropelab.files import new_folder, refuse_existing
from ropelab.model import Transformer
from ropelab.sources.hf_models import Converted
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
        config = build_run_config(parse_yaml(converted_run_config(model.config, spec).to_yaml()))  # validated, as loading reads it
        (tmp / CONFIG).write_text(config.to_yaml())
        save_weights_only(tmp, 0, model, config)
        (tmp / IMPORT).write_text(json.dumps(record, indent=2))
    return out / "checkpoints" / ckpt.step_dir(out, 0).name


def write_converted(converted: Converted, out_dir: str | Path, source: str, kind: str) -> Path:
    """`write_imported` of a model converted from `source` (its location, of kind `kind`), import.json
    saying where the weights came from. Returns the checkpoint folder."""
    record = {"source": source, "kind": kind, "architecture": converted.architecture,
              "transformers": converted.transformers_version, "tokenizer": converted.tokenizer_note}
    return write_imported(converted.model, out_dir, converted.tokenizer_spec, record, converted.tokenizer)


__all__ = ["TOKENIZER", "save_weights_only", "converted_run_config", "write_imported", "write_converted"]
