"""Models that transformers loads: Hugging Face folders and hub names, and GGUF files.

  load_hf_model(source, dtype)   the transformers causal LM itself (a teacher may run it natively)
  hf_text_config(source)         its configuration, without weights
  hf_tokenizer(source)           the tokenizer of an `hf` source, or of a folder ropelab exported
  tokenizer_spec(source, vocab)  (data.tokenizer for a run of its model, what happened to the tokenizer, the
                                 tokenizer an imported folder saves)
  convert(source)                -> `Converted`: the ropelab Transformer computing the same logits
                                 (`ropelab.sources.hf.from_hf`), with the tokenizer it reads

Every transformers call passes `trust_remote_code` explicitly: the Source's, False unless the user
asked for it, so Python files shipped with a model, its config or its tokenizer never run unasked
(transformers would otherwise ask on standard input, where a "y" would run them).

Hub names go through `ropelab.hub`: when the hub is unreachable they resolve from the local cache
only, so a missing model fails at once instead of retrying. transformers is imported inside the
functions that need it (`ropelab.sources.transformers_lib`): it is an optional dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ropelab import hub
from ropelab.config import ConfigError
from ropelab.data.tokenizer import ByteTokenizer, HFTokenizer, load_hf_tokenizer
from ropelab.errors import load_failure, one_line
from ropelab.model import Transformer
from ropelab.sources.gguf import load_gguf
from ropelab.sources.gguf_files import BUILTIN_SOURCES
from ropelab.sources.hf import from_hf
from ropelab.sources.locate import Source
from ropelab.sources.transformers_lib import dtype_kwargs, require_transformers

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Converted:
    model: Transformer  # fp32, eval mode, on the CPU
    architecture: str  # the transformers class it came from
    tokenizer_spec: str  # data.tokenizer for a run of this model
    tokenizer_note: str  # what happened to the tokenizer, for the user
    tokenizer: Optional[HFTokenizer] = None  # the tokenizer an imported folder holds (None: data.tokenizer=bytes)
    transformers_version: str = ""


def _expect(source: Source, *kinds: str) -> None:
    if source.kind not in kinds:
        raise ConfigError(f"{source.name}: a ropelab {source.kind}, not a model transformers loads")


def load_hf_model(source: Source, dtype: torch.dtype = torch.float32):
    """The transformers causal LM of an `hf` or `gguf` source, in eval mode. ConfigError (one line)
    when it cannot be loaded."""
    _expect(source, "hf", "gguf")
    if source.kind == "gguf":
        return load_gguf(source.location, dtype)[0]
    transformers = require_transformers("loading Hugging Face models")
    if not Path(source.location).exists():
        hub.offline_unless_reachable()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.location, trust_remote_code=source.trust_remote_code, **dtype_kwargs(transformers, dtype))
    except Exception as exc:  # noqa: BLE001 - offline hub, missing repo, unknown architecture: one line
        raise ConfigError(f"{source.name}: could not load a causal LM ({load_failure(exc, source.trust_remote_code)})") from None
    return model.eval()


def hf_text_config(source: Source):
    """The configuration of an `hf` source's language model (its text part), without weights."""
    _expect(source, "hf")
    transformers = require_transformers("loading Hugging Face models")
    if not Path(source.location).exists():
        hub.offline_unless_reachable()
    try:
        config = transformers.AutoConfig.from_pretrained(source.location, trust_remote_code=source.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - missing repo, offline, bad folder: one line
        raise ConfigError(f"{source.name}: could not load its config ({load_failure(exc, source.trust_remote_code, 200)})") from None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def has_tokenizer_files(source: Source) -> bool:
    path = Path(source.location)
    return not path.is_dir() or any((path / name).is_file() for name in _TOKENIZER_FILES)


def hf_tokenizer(source: Source) -> HFTokenizer:
    """The tokenizer of an `hf` or `export` source (its folder's files, or the hub's)."""
    _expect(source, "hf", "export")
    if not has_tokenizer_files(source):
        raise ConfigError(f"{source.name}: has no tokenizer files")
    path = Path(source.location)
    return load_hf_tokenizer(str(path.resolve()) if path.exists() else source.location, source.trust_remote_code)


def tokenizer_spec(source: Source, model_vocab: int) -> tuple[str, str, Optional[HFTokenizer]]:
    """(data.tokenizer for a run of an `hf` or `export` source's model, what happened, the tokenizer an
    imported folder saves as its own, or None when the run reads bytes)."""
    if not has_tokenizer_files(source):
        why = "no tokenizer files"
    else:
        try:
            tokenizer = hf_tokenizer(source)
        except ConfigError as exc:  # a broken or slow-only tokenizer: fall back to bytes, and say why
            why = f"tokenizer not usable ({one_line(exc, 150)})"
        else:
            if tokenizer.vocab_size <= model_vocab:
                return tokenizer.name, f"saved from {tokenizer.name} ({tokenizer.vocab_size} tokens)", tokenizer
            why = f"tokenizer has {tokenizer.vocab_size} tokens, model {model_vocab}"
    note = f"{why}; data.tokenizer=bytes"
    if model_vocab < ByteTokenizer.vocab_size:
        note += f" (but the model has only {model_vocab} tokens: set data.tokenizer before training)"
    return "bytes", note, None


def convert(source: Source) -> Converted:
    """The ropelab model of an `hf` or `gguf` source, with what a run of it needs to read its tokens."""
    _expect(source, "hf", "gguf")
    if source.kind == "gguf":
        hf_model, hf_tok = load_gguf(source.location, torch.float32)
        tokenizer = HFTokenizer(hf_tok.backend_tokenizer, source.name, eos=hf_tok.eos_token)
    else:
        hf_model, tokenizer = load_hf_model(source, torch.float32), None
    transformers = require_transformers("converting Hugging Face and GGUF models")  # its version, for import.json
    try:
        model = from_hf(hf_model).float().eval()
    except ValueError as exc:
        raise ConfigError(f"{source.name}: no exact ropelab equivalent: {exc}") from None
    architecture = type(hf_model).__name__
    del hf_model
    model.config.name = source.name if source.kind == "hf" or source.name in BUILTIN_SOURCES else Path(source.location).stem
    if tokenizer is not None:
        spec, note = source.name, f"saved from the GGUF file ({tokenizer.vocab_size} tokens)"
    else:
        spec, note, tokenizer = tokenizer_spec(source, model.config.vocab_size)
    return Converted(model, architecture, spec, note, tokenizer, transformers.__version__)


__all__ = ["Converted", "convert", "load_hf_model", "hf_text_config", "hf_tokenizer", "has_tokenizer_files",
           "tokenizer_spec"]
