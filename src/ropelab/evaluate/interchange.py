"""Export trained runs as native Hugging Face model folders, and import HF models as ropelab folders.

  load_model(path)              a run directory (latest complete checkpoint), one checkpoint folder
                                ``<run>/checkpoints/step_N/``, or a folder written by `import_hf`
                                -> (Transformer, RunConfig), fp32 on the CPU, eval mode
  export_hf(path, out_dir)      `save_hf` of the run's model, with its tokenizer when tokenizers-backed
  save_hf(model, out_dir)       `to_hf(model).save_pretrained(out_dir)` (safetensors, no remote code)
                                when a native class is exactly equivalent, else ropelab's modeling code
                                shipped in the folder (`remote_code`, trust_remote_code=True); plus
                                generation_config.json
  import_hf(name_or_path, dir)  `AutoModelForCausalLM.from_pretrained` -> `from_hf` -> a run-like folder:
                                config.yaml + checkpoints/step_00000000/ (a step-0 checkpoint)

Both writers refuse an existing non-empty `out_dir` and build the folder under a temporary name
next to it, renamed into place when complete, so a failure never leaves a half-written folder.
User mistakes (wrong path, non-empty out_dir, offline hub) raise a one-line `ConfigError`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import yaml

from ropelab.config import ConfigError, DataConfig, RunConfig, build_run_config
from ropelab.errors import one_line
from ropelab.model import Transformer
from ropelab.train import checkpoint as ckpt

_STEP = re.compile(r"step_(\d+)")
_HF_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face export/import needs transformers: pip install 'ropelab[hf]'") from None
    return transformers


# ------------------------------------------------------------------ loading


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory holding config.yaml, complete checkpoint folder) for a run, checkpoint or imported folder."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such file or directory")
    if p.is_dir() and (p / "config.yaml").is_file():  # a run directory or an imported folder
        latest = ckpt.latest_checkpoint(p)
        if latest is None:
            raise ConfigError(f"{p}: no complete checkpoint (checkpoints/step_N/ with a {ckpt.MARKER} marker)")
        return p, latest
    if p.is_dir() and _STEP.fullmatch(p.name) and p.parent.name == "checkpoints":
        if not (p / ckpt.MARKER).is_file():
            raise ConfigError(f"{p}: incomplete checkpoint (no {ckpt.MARKER} marker); refusing to load it")
        run_dir = p.parent.parent
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{p}: checkpoint without its run's config.yaml (expected {run_dir / 'config.yaml'})")
        return run_dir, p
    if p.is_dir() and any((p / name).is_file() for name in _HF_MARKERS):
        raise ConfigError(f"{p}: a Hugging Face model folder, not a ropelab run; convert it with `ropelab import {p} --out DIR`")
    raise ConfigError(
        f"{p}: not a ropelab run directory (config.yaml + checkpoints/), a checkpoint folder "
        "(<run>/checkpoints/step_N/) or a folder written by `ropelab import`"
    )


def checkpoint_config(path: str | Path) -> tuple[RunConfig, Path]:
    """(the configuration the trainer held at the checkpoint, the checkpoint folder) for a run, a
    checkpoint or an imported folder: for a multi-phase run, that phase's config (its RoPE theta,
    sequence length, ...)."""
    from ropelab.train.loop import load_run_config

    run_dir, folder = resolve_checkpoint(path)
    config = load_run_config(run_dir)
    if not ckpt.has_weights(folder):
        raise ConfigError(f"{folder}: no model.safetensors (nor a dcp/ checkpoint)")
    if config.model.vocab_size is None:  # config.yaml written before the vocabulary was known
        config.model.vocab_size = ckpt.weights_vocab(folder)
    return _config_at(config, folder), folder


def load_model(path: str | Path) -> tuple[Transformer, RunConfig]:
    """The model of a run (its latest complete checkpoint), of one checkpoint folder, or of an imported
    folder, with its configuration (`checkpoint_config`). fp32 on the CPU, eval mode."""
    config, folder = checkpoint_config(path)
    model = Transformer(config.model)
    ckpt.load_weights(model, folder)
    return model.eval(), config


def _config_at(config: RunConfig, folder: Path) -> RunConfig:
    """A multi-phase run's config as the trainer held it at the checkpoint's step: that phase's
    overrides (e.g. RoPE theta 10k after the short phase, 500k after the long one)."""
    from ropelab.train.phases import phase_at, resolve_phases

    match = _STEP.fullmatch(folder.name)
    if not config.train.phases or match is None:
        return config
    phase = phase_at(resolve_phases(config), max(int(match[1]) - 1, 0)).config
    phase.model.vocab_size = config.model.vocab_size
    return phase


# ------------------------------------------------------------------ output folders


@contextmanager
def _new_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir`, renamed to `out_dir` when the block succeeds (removed if not).
    Refuses an `out_dir` that exists and is not an empty folder: nothing is ever overwritten."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists() and (not out.is_dir() or any(out.iterdir())):  # appeared while we were writing
            raise ConfigError(f"{out}: was filled by someone else meanwhile; the export stays unwritten")
        os.replace(tmp, out)  # POSIX rename replaces an empty directory
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ export


def _export_tokenizer(config: RunConfig):
    """(the run's HFTokenizer, None) or (None, why no tokenizer files are written)."""
    from ropelab.data.tokenizer import ByteTokenizer, load_tokenizer

    data = config.data
    tokenizer = load_tokenizer(data.tokenizer, data.corpus, data.val_percent)  # ConfigError if unavailable
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer, (
            "skipped: the byte tokenizer has no tokenizers-backed equivalent "
            f"(ids 0-255 are UTF-8 bytes; eos={tokenizer.eos_id}, bos={tokenizer.bos_id}, pad={tokenizer.pad_id})"
        )
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer={data.tokenizer!r}: {tokenizer.vocab_size} tokens but the model has only "
            f"{config.model.vocab_size}; not the run's tokenizer"
        )
    return tokenizer, None


def _hf_tokenizer(tokenizer, max_len: int):
    from tokenizers import Tokenizer as RustTokenizer

    transformers = _transformers()
    name = lambda i: None if i is None else tokenizer.tok.id_to_token(i)  # noqa: E731
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=RustTokenizer.from_str(tokenizer.tok.to_str()),  # a copy: the wrapper may edit it
        eos_token=name(tokenizer.eos_id), bos_token=name(tokenizer.bos_id), pad_token=name(tokenizer.pad_id),
        model_max_length=max_len,
    )


def save_hf(model: Transformer, out_dir: str | Path, token_ids: dict | None = None, tokenizer=None) -> dict:
    """Write `model` (its config is `model.config`) as a Hugging Face folder `out_dir`, no run needed.

    Route "native": the exactly equivalent transformers class (`hf_architecture`), no remote code.
    Route "remote_code" when there is none: ropelab's own modeling code ships in the folder with
    `auto_map` (see `remote_code`); load it with `trust_remote_code=True`. `token_ids`: bos/eos/pad
    ids for the configs (ids outside the vocabulary are dropped); `tokenizer`: a transformers
    tokenizer saved alongside. Returns route, architecture, files, and why (no native class)."""
    from ropelab.evaluate import remote_code
    from ropelab.evaluate.hf import _ARCHS, hf_architecture, to_hf

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out (nothing is overwritten)")
    transformers = _transformers()
    try:
        arch, why = _ARCHS[hf_architecture(model.config)].model_class, None
    except ValueError as exc:
        arch, why = None, str(exc)
    hf_model = to_hf(model) if why is None else remote_code.to_remote_hf(model)
    vocab = model.config.vocab_size
    ids = {k: v if v is not None and v < vocab else None for k, v in (token_ids or {}).items()}  # no stray ids
    for key, value in ids.items():
        setattr(hf_model.config, key, value)
    generation = transformers.GenerationConfig(**ids, **({} if why is None else {"use_cache": False}))
    hf_model.generation_config = generation
    with _new_folder(out) as tmp:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        if not (tmp / "generation_config.json").is_file():
            generation.save_pretrained(tmp)
        if why is not None:
            remote_code.write_remote_code(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir())
    info = {"route": "native" if why is None else "remote_code", "architecture": arch or type(hf_model).__name__}
    return info | {"files": files} | ({} if why is None else {"why": why})


def export_hf(path: str | Path, out_dir: str | Path) -> dict:
    """Write the run/checkpoint at `path` as a Hugging Face model folder `out_dir` (see `save_hf`):
    its native transformers class when one is exactly equivalent, else with ropelab's modeling code
    (load with trust_remote_code=True).

    Returns a summary: out_dir, route ("native" | "remote_code"), architecture (HF class), checkpoint,
    step, files, tokenizer (what was done about it), and why (no native class) for remote code.
    Raises ConfigError for a non-empty `out_dir`."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # fail before loading anything
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out (nothing is overwritten)")
    _transformers()
    model, config = load_model(path)
    _, folder = resolve_checkpoint(path)
    tokenizer, skipped = _export_tokenizer(config)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    hf_tokenizer = None if skipped else _hf_tokenizer(tokenizer, config.model.max_seq_len)
    info = save_hf(model, out, token_ids=ids, tokenizer=hf_tokenizer)
    return {
        "out_dir": str(out),
        "route": info["route"],
        "architecture": info["architecture"],
        "checkpoint": str(folder),
        "step": int(_STEP.fullmatch(folder.name)[1]),
        "files": info["files"],
        "tokenizer": skipped or f"saved ({config.data.tokenizer}, {tokenizer.vocab_size} tokens)",
    } | ({"why": info["why"]} if "why" in info else {})


# ------------------------------------------------------------------ import


def _is_local(name: str) -> bool:
    """A filesystem path rather than a hub id ("org/name"): exists, or is spelled like a path."""
    return (
        Path(name).exists() or os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
        or os.sep != "/" and os.sep in name
    )


def _import_tokenizer(name_or_path: str, model_vocab: int) -> tuple[str, str]:
    """(data.tokenizer for the imported run, what happened)."""
    from ropelab.data.tokenizer import load_hf_tokenizer

    path = Path(name_or_path)
    if path.is_dir() and not any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return "bytes", "no tokenizer files; data.tokenizer=bytes"
    spec = str(path.resolve()) if path.exists() else name_or_path
    try:
        tokenizer = load_hf_tokenizer(spec)
    except Exception as exc:  # noqa: BLE001 - any failure: fall back to bytes, and say why
        return "bytes", f"tokenizer not usable ({one_line(exc, 150)}); data.tokenizer=bytes"
    if tokenizer.vocab_size > model_vocab:
        return "bytes", f"tokenizer has {tokenizer.vocab_size} tokens, model {model_vocab}; data.tokenizer=bytes"
    return spec, f"data.tokenizer={spec}"


def save_weights_only(run_dir: Path, step: int, model: Transformer, config: RunConfig) -> Path:
    """A complete checkpoint `run_dir/checkpoints/step_<step>/` (save_checkpoint's layout and marker)
    holding `model`'s weights, a fresh optimizer state and the RNG state, so `load_model` reads it and
    a resumed training run would start from these weights at `step`."""
    from ropelab.train.optim import build_optimizer

    extra = {"data": {"seed": config.seed, "next_step": step}}
    return ckpt.save_checkpoint(run_dir, step, model, build_optimizer(model, config.train), extra, keep=1)


def import_hf(name_or_path: str, out_dir: str | Path) -> dict:
    """Convert a Llama/Qwen2/Qwen3/GPT-NeoX causal LM (hub name or local folder) into a ropelab folder
    `out_dir` (config.yaml + checkpoints/step_00000000/) that `load_model` reads.

    Returns a summary: out_dir, architecture, checkpoint, params, tokenizer. Raises ConfigError (one
    line) when the model cannot be loaded or has no exact ropelab equivalent."""
    from ropelab.evaluate.hf import from_hf

    name_or_path = str(name_or_path)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: already exists and is not empty; choose a new --out (nothing is overwritten)")
    if _is_local(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise ConfigError(f"{name_or_path}: no such model folder (and not a hub name like org/model)")
    transformers = _transformers()
    source = str(Path(name_or_path).expanduser()) if _is_local(name_or_path) else name_or_path
    from packaging.version import Version

    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(source, **{dtype_key: torch.float32})
    except Exception as exc:  # noqa: BLE001 - offline hub, missing repo, unknown architecture: one line
        raise ConfigError(f"{name_or_path}: could not load a causal LM ({one_line(exc, 300)})") from None
    try:
        model = from_hf(hf_model).float().eval()
    except ValueError as exc:
        raise ConfigError(f"{name_or_path}: no exact ropelab equivalent: {exc}") from None
    hf_class = type(hf_model).__name__
    del hf_model

    model_config = model.config
    spec, tokenizer_note = _import_tokenizer(source, model_config.vocab_size)
    if spec == "bytes" and model_config.vocab_size < 259:
        tokenizer_note += f" (but the model has only {model_config.vocab_size} tokens: set data.tokenizer before training)"
    config = RunConfig(model=model_config, data=DataConfig(tokenizer=spec, seq_len=min(256, model_config.max_seq_len)))
    config = build_run_config(yaml.safe_load(config.to_yaml()))  # validated, and exactly what load_model will read
    with _new_folder(out) as tmp:
        (tmp / "config.yaml").write_text(config.to_yaml())
        folder = save_weights_only(tmp, 0, model, config)
        (tmp / "import.json").write_text(json.dumps({
            "source": str(Path(source).resolve()) if _is_local(name_or_path) else name_or_path, "architecture": hf_class, "transformers": transformers.__version__,
            "tokenizer": tokenizer_note,
        }, indent=2))
    return {
        "out_dir": str(out),
        "source": name_or_path,
        "architecture": hf_class,
        "checkpoint": str(out / "checkpoints" / folder.name),
        "params": model.num_params(),
        "tokenizer": tokenizer_note,
    }


__all__ = ["load_model", "resolve_checkpoint", "export_hf", "save_hf", "import_hf", "save_weights_only"]
