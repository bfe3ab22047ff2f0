"""Loading a model source: `load` (weights, tokenizer, config) and `load_config` (config alone).

Hugging Face models are converted in memory (`ropelab.sources.hf`); a folder ropelab exported with
its own modeling code is read with ropelab's classes (`ropelab.sources.exported`), never its shipped
code. `trust_remote_code` (default False) lets transformers run code shipped with an HF model or its
tokenizer. A GGUF file is dequantized and converted once, into an imported folder under the ropelab
cache (``$ROPELAB_CACHE/imports/``, keyed by the file's path, size and modification time), which
later loads read directly.
"""


from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

from ropelab.config import ConfigError, RunConfig
from ropelab.data.tokenizer import Tokenizer, cache_dir, load_tokenizer
from ropelab.model import Transformer
from ropelab.sources import hf_models
from ropelab.sources.exported import export_model_config
from ropelab.sources.hf import model_config_from_hf
from ropelab.sources.imported import converted_run_config, import_model
from ropelab.sources.locate import Source, resolve
from ropelab.sources.runs import checkpoint_config, is_run_dir
from ropelab.train import checkpoint as ckpt


class Loaded(NamedTuple):
    model: Transformer
    tokenizer: Tokenizer
    config: RunConfig


def cached_import(source: Source) -> Source:
    """The imported folder of a GGUF source in the ropelab cache, made now if absent."""
    path = Path(source.location)
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "imports" / f"{path.stem}-{key}"
    complete = lambda: is_run_dir(folder) and ckpt.latest_checkpoint(folder) is not None  # noqa: E731
    if not complete():
        try:
            import_model(source.location, folder)
        except ConfigError:
            if not complete():
                raise  # not merely another process that imported it first
    found = resolve(folder)
    return Source(source.name, found.kind, found.location, found.run_dir, found.checkpoint)


def _ropelab_source(name: str | Path | Source, trust_remote_code: bool) -> Source:
    source = resolve(name, trust_remote_code)
    return cached_import(source) if source.kind == "gguf" else source


def load_config(name: str | Path | Source, trust_remote_code: bool = False) -> tuple[RunConfig, Source]:
    """The run configuration of a source, without its weights (a GGUF file is imported first)."""
    source = _ropelab_source(name, trust_remote_code)
    if source.is_ropelab:
        return checkpoint_config(source.checkpoint)[0], source
    if source.kind == "export":
        model_config = export_model_config(source.location)
    else:
        model_config = model_config_from_hf(hf_models.hf_text_config(source))
    spec = hf_models.hf_tokenizer(source).name if hf_models.has_tokenizer_files(source) else "bytes"
    return converted_run_config(model_config, spec), source


def load(name: str | Path | Source, trust_remote_code: bool = False) -> Loaded:
    """(model in fp32 eval mode on the CPU, its tokenizer, its run configuration) for any source."""
    source = _ropelab_source(name, trust_remote_code)
    if source.is_ropelab:
        config, folder = checkpoint_config(source.checkpoint)
        model = Transformer(config.model)
        ckpt.load_weights(model, folder)
        model.eval()
    else:
        converted = hf_models.convert(source)
        model = converted.model
        config = converted_run_config(model.config, converted.tokenizer_spec)
    data = config.data
    return Loaded(model, load_tokenizer(data.tokenizer, data.corpus, data.val_percent, source.trust_remote_code), config)


__all__ = ["Loaded", "load", "load_config", "cached_import"]
