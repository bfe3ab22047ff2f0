"""Reading GGUF files: header inspection, and loading through transformers.

  inspect_gguf(path) -> GGUFInfo     the header only (memory-mapped, nothing dequantized), refusing
                                     what transformers cannot load
  load_gguf(path, dtype) -> (hf_model, hf_tokenizer)
                                     the dequantized transformers causal LM and its fast tokenizer
  load_gguf_tokenizer(path)          the fast tokenizer alone (`data.tokenizer` of a built-in name)

Which names and paths are GGUF files: `ropelab.sources.gguf_files`. `ropelab.sources.hf.from_hf`
turns the loaded model into a ropelab `Transformer`. Every refusal is a one-line `ConfigError` naming
the file and what is allowed.

transformers and gguf are heavy optional dependencies, so they are imported inside the functions
that need them, never at module import.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ropelab.config import ConfigError
from ropelab.sources.gguf_files import GGUF_MAGIC
from ropelab.sources.transformers_lib import INSTALL, dtype_kwargs, require_transformers

# GGUF architecture names that transformers renames before its support check (see its
# `load_gguf_checkpoint`); without them a supported MoE or GPT-OSS file would be refused here.
_ARCH_ALIASES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}
_NOT_ARCHITECTURES = {"general", "tokenizer"}  # metadata sections in transformers' table


@dataclass(frozen=True)
class GGUFInfo:
    path: Path  # absolute
    architecture: str  # general.architecture, as the file spells it
    quantizations: tuple[str, ...]  # tensor types present, most common first (e.g. ("Q4_1", "F32", "Q8_0"))
    tensor_count: int
    context_length: Optional[int]
    vocab_size: Optional[int]  # {arch}.vocab_size, else the tokenizer's token count; None if neither


# ------------------------------------------------------------------ helpers


def _one_line(text: object, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    message = _one_line(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _shortened(values, shown: int = 12) -> str:
    values = list(values)
    head = ", ".join(values[:shown])
    return head + (f" (+{len(values) - shown} more)" if len(values) > shown else "")


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"reading GGUF files needs the gguf package: {INSTALL}") from None
    return gguf


def supported_architectures() -> list[str]:
    """GGUF architectures the installed transformers can load, from its own table."""
    require_transformers("loading GGUF files")
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES as names
    except ImportError:  # older layouts: the config table in integrations.ggml
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        names = list(GGUF_CONFIG_MAPPING)
    return [name for name in names if name not in _NOT_ARCHITECTURES]


def supported_quantizations() -> Optional[list[str]]:
    """Tensor types gguf's `dequantize` (what transformers calls) handles; None when unknown."""
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import _type_traits  # private; the registry `dequantize` dispatches on
    except ImportError:
        return None
    types = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    return [t.name for t in sorted(types, key=lambda t: t.value)]


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a value the reader parsed but cannot decode: treat as absent
        return None


# ------------------------------------------------------------------ public API

# (resolved path, size, mtime_ns) -> GGUFInfo of files that passed: parsing a header with a large
# token table takes seconds, and a load usually follows an inspection of the same file.
_INSPECTED: dict[tuple[str, int, int], GGUFInfo] = {}


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """The header of a GGUF file that transformers can load, or a one-line ConfigError naming it."""
    shown = str(path)
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"{shown}: {what}; expected a GGUF file")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _INSPECTED:
        _INSPECTED[key] = _inspect(path, shown)
    return _INSPECTED[key]


def _inspect(path: Path, shown: str) -> GGUFInfo:
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot read ({_describe(exc)})") from None
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{shown}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")

    gguf = _gguf_module()
    try:
        reader = gguf.GGUFReader(path, "r")  # memory-mapped: parses the header, reads no tensor data
        tensors = list(reader.tensors)
        architecture = _field(reader, "general.architecture")
        context_length = _field(reader, f"{architecture}.context_length")
        vocab_size = _field(reader, f"{architecture}.vocab_size")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if vocab_size is None and tokens is not None:
            vocab_size = len(tokens.data)
    except Exception as exc:  # the reader fails in many ways on a damaged file (ValueError, IndexError, ...)
        raise ConfigError(
            f"{shown}: truncated or damaged GGUF file ({_describe(exc)}); expected a complete GGUF v2/v3 file"
        ) from None
    size = path.stat().st_size
    for tensor in tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ConfigError(
                f"{shown}: truncated GGUF file (tensor {tensor.name} ends at byte "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size})"
            )

    supported = supported_architectures()
    if not isinstance(architecture, str) or not architecture:
        raise ConfigError(f"{shown}: no general.architecture in the GGUF header; supported: {_shortened(supported)}")
    if architecture not in supported and _ARCH_ALIASES.get(architecture) not in supported:
        raise ConfigError(
            f"{shown}: GGUF architecture {architecture!r} is not loadable by transformers "
            f"{require_transformers('loading GGUF files').__version__}; supported: {_shortened(supported)}"
        )

    counts = Counter(t.tensor_type.name for t in tensors)
    known = supported_quantizations()
    if known is not None:
        unknown = sorted(set(counts) - set(known))
        if unknown:
            raise ConfigError(
                f"{shown}: tensor type(s) {', '.join(unknown)} cannot be dequantized; supported: {_shortened(known)}"
            )
    return GGUFInfo(
        path=path.resolve(),
        architecture=architecture,
        quantizations=tuple(name for name, _ in counts.most_common()),
        tensor_count=len(tensors),
        context_length=int(context_length) if context_length is not None else None,
        vocab_size=int(vocab_size) if vocab_size is not None else None,
    )


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32):
    """(transformers causal LM in eval mode, its fast tokenizer) from a GGUF file, weights dequantized
    to `dtype`. ConfigError (one line, naming the file) on any failure."""
    info = inspect_gguf(path)
    transformers = require_transformers("loading GGUF files")
    folder, name = str(info.path.parent), info.path.name
    try:
        model, report = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, output_loading_info=True, trust_remote_code=False, **dtype_kwargs(transformers, dtype)
        )
    except Exception as exc:
        raise ConfigError(f"{path}: transformers could not load the GGUF model ({_describe(exc)})") from None
    # transformers fills weights absent from the file (or of the wrong shape) with random values and
    # only logs it; a model that is partly random is refused instead.
    absent = sorted({*report.get("missing_keys", ()), *(k[0] for k in report.get("mismatched_keys", ()))})
    if absent:
        raise ConfigError(
            f"{path}: the GGUF file lacks {len(absent)} weight(s) {type(model).__name__} needs "
            f"({_shortened(absent, 3)}); a complete model file is needed"
        )
    return model.eval(), load_gguf_tokenizer(path)


def load_gguf_tokenizer(path: str | Path):
    """The fast transformers tokenizer of a GGUF file (its token table only; no weights are read).
    ConfigError (one line, naming the file) on any failure."""
    info = inspect_gguf(path)
    transformers = require_transformers("loading GGUF files")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=info.path.name,
                                                               trust_remote_code=False)  # a GGUF file holds no code
    except Exception as exc:
        raise ConfigError(f"{path}: transformers could not load the GGUF tokenizer ({_describe(exc)})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"{path}: the GGUF tokenizer loaded as {type(tokenizer).__name__}; a fast tokenizer is needed"
        )
    return tokenizer


__all__ = [
    "GGUFInfo", "inspect_gguf", "load_gguf", "load_gguf_tokenizer", "supported_architectures", "supported_quantizations",
]
