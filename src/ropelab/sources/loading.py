"""Getting a model out of a source: into memory, or into a ropelab folder.

  load(name) -> Loaded              (model, tokenizer, run configuration)
  load_config(name)                 (run configuration, Source), without the weights
  import_model(name, out_dir)       the model as a folder every command takes (`ropelab import`,
                                    `ropelab.sources.imported`)
  cached_import(source)             a GGUF source's imported folder in the ropelab cache, made now if absent

`ropelab.sources.locate.resolve` decides the kind of a source once; each kind then has one loader:

  run, checkpoint   the checkpoint's weights and its phase's configuration (`ropelab.sources.runs`)
  export            ropelab's own classes (`ropelab.sources.exported`), never the folder's shipped code
  hf                transformers, converted in memory (`ropelab.sources.hf_models`)
  gguf              dequantized and converted once, into an imported folder under the ropelab cache
                    (``$ROPELAB_CACHE/imports/``, keyed by the file's path, size and modification time),
                    which this and later loads read as a run

`trust_remote_code` (default False) lets transformers run code shipped with an HF model or its tokenizer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

from ropelab.config import ConfigError, RunConfig
from ropelab.data.tokenizer import Tokenizer, cache_dir, load_tokenizer
from ropelab.files import one_at_a_time, refuse_existing
from ropelab.model import Transformer
from ropelab.sources.exported import export_model_config, load_export
from ropelab.sources.hf_config_read import model_config_from_hf
from ropelab.sources.hf_models import Converted, convert, has_tokenizer_files, hf_text_config, hf_tokenizer, tokenizer_spec
from ropelab.sources.imported import converted_run_config, write_converted
from ropelab.sources.locate import Source, resolve
from ropelab.sources.runs import CONFIG, checkpoint_config
from ropelab.train import checkpoint as ckpt


class Loaded(NamedTuple):
    model: Transformer
    tokenizer: Tokenizer
    config: RunConfig


def _imported(source: Source) -> tuple[Path, Path]:
    """(folder, checkpoint) of a GGUF source imported into the ropelab cache, imported now if absent."""
    path = Path(source.location)
    file, stat = path.resolve(), path.stat()
    key = hashlib.sha1(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "imports" / f"{path.stem}-{key}"
    latest = lambda: ckpt.latest_checkpoint(folder) if (folder / CONFIG).is_file() else None  # noqa: E731
    checkpoint = latest()
    if checkpoint is None:
        with one_at_a_time(folder.parent / f".{folder.name}.lock"):  # a second process waits, then reads it
            checkpoint = latest()
            if checkpoint is None:
                converted = _converted(source)
                converted.model.config.name = file.stem  # the folder is the file's, whichever name reached it
                checkpoint = write_converted(converted, folder, str(file), source.kind)
    return folder, checkpoint


def cached_import(source: Source) -> Source:
    """The imported folder of a GGUF source in the ropelab cache (a run), made now if absent."""
    folder, checkpoint = _imported(source)
    return Source(source.name, "run", str(folder), folder, checkpoint)


def _converted(source: Source) -> Converted:
    """The ropelab model of an `export`, `hf` or `gguf` source, with what a run of it needs to read its tokens."""
    if source.kind != "export":
        return convert(source)
    model = load_export(source.location)
    return Converted(model, "RopelabForCausalLM", *tokenizer_spec(source, model.config.vocab_size))


def _from_checkpoint(checkpoint: Path) -> tuple[Transformer, RunConfig]:
    config, folder = checkpoint_config(checkpoint)
    model = Transformer(config.model, init=False)
    ckpt.load_weights(model, folder)
    return model.eval(), config


def load(name: str | Path | Source, trust_remote_code: bool = False) -> Loaded:
    """(model in fp32 eval mode on the CPU, its tokenizer, its run configuration) for any source."""
    source = resolve(name, trust_remote_code)
    if source.kind in ("run", "checkpoint"):
        model, config = _from_checkpoint(source.checkpoint)
    elif source.kind == "gguf":
        model, config = _from_checkpoint(_imported(source)[1])
    else:
        converted = _converted(source)
        model, config = converted.model, converted_run_config(converted.model.config, converted.tokenizer_spec)
    data = config.data
    return Loaded(model, load_tokenizer(data.tokenizer, data.corpus, data.val_percent, source.trust_remote_code), config)


def load_config(name: str | Path | Source, trust_remote_code: bool = False) -> tuple[RunConfig, Source]:
    """The run configuration of a source, without its weights (a GGUF file is imported first)."""
    source = resolve(name, trust_remote_code)
    if source.kind == "gguf":
        source = cached_import(source)
    if source.kind in ("run", "checkpoint"):
        return checkpoint_config(source.checkpoint)[0], source
    if source.kind == "export":
        model_config = export_model_config(source.location)
    else:
        model_config = model_config_from_hf(hf_text_config(source))
    spec = hf_tokenizer(source).name if has_tokenizer_files(source) else "bytes"
    return converted_run_config(model_config, spec), source


def import_model(source: str, out_dir: str | Path, trust_remote_code: bool = False) -> dict:
    """Convert a Llama/SmolLM3/Qwen2/Qwen3/GPT-NeoX causal LM (hub name, HF folder, GGUF file or built-in name),
    or a folder ropelab exported with its own modeling code, into a ropelab folder `out_dir` that every
    command reads. `trust_remote_code` lets transformers run code shipped with an HF model.

    Returns a summary: out_dir, source, architecture, checkpoint, params, tokenizer. Raises ConfigError
    (one line) when the model cannot be loaded or has no exact ropelab equivalent; nothing is written then."""
    out = refuse_existing(out_dir)
    found = resolve(source, trust_remote_code)
    if found.kind not in ("hf", "export", "gguf"):
        raise ConfigError(f"{source}: already a ropelab {found.kind}; nothing to import (every command takes it as it is)")
    converted = _converted(found)
    folder = write_converted(converted, out, found.location, found.kind)
    return {
        "out_dir": str(out), "source": source, "architecture": converted.architecture,
        "checkpoint": str(folder), "params": converted.model.num_params(), "tokenizer": converted.tokenizer_note,
    }


__all__ = ["Loaded", "load", "load_config", "import_model", "cached_import"]
