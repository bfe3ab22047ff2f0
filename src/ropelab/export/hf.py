"""Export ropelab models as Hugging Face model folders.

  export_hf(source, out_dir)    `save_hf` of a source's model (`ropelab.sources.load`), with its
                                tokenizer (the byte tokenizer as `ByteTokenizer.to_tokenizers`)
  save_hf(model, out_dir)       `to_hf(model).save_pretrained(out_dir)` (safetensors, no remote code)
                                when a native class is exactly equivalent, else ropelab's modeling code
                                shipped in the folder (`remote_code`, trust_remote_code=True); plus
                                generation_config.json

An exported folder scores like its run (lm-eval's ``--model hf`` on it gives every item the number
``--model ropelab`` gives on the run, `ropelab.evaluate.lm_eval`), because it carries ropelab's scoring
defaults where HFLM reads them:

  * the tokenizer declares no BOS, so HFLM prefixes empty contexts and rolling windows with EOS (it takes
    BOS when the tokenizer names one), as ropelab does: ropelab puts EOS between documents and never
    prepends a BOS to a text; config.json and generation_config.json name no BOS either;
  * the tokenizer adds no special tokens on encoding (a post-processor that adds them is dropped):
    transformers encodes with add_special_tokens=True by default, ropelab without;
  * config.json's ``n_positions`` is the context the weights were trained at (`trained_length`: a run's
    data.seq_len), which HFLM reads as its max_length before ``max_position_embeddings`` (the model's
    position capacity, model.max_seq_len, kept: RoPE scalings compute with it).

Both refuse an existing non-empty `out_dir` and build the folder under a temporary name next to it,
renamed into place when complete (`ropelab.files.new_folder`), so a failure never leaves a
half-written folder. User mistakes (wrong path, non-empty out_dir) raise a one-line `ConfigError`.
"""

from __future__ import annotations

from pathlib import Path

from ropelab.config import ConfigError, RunConfig
from ropelab.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from ropelab.evaluate.trained_context import trained_length
from ropelab.export import remote_code
from ropelab.files import new_folder, refuse_existing
from ropelab.model import Transformer
from ropelab.sources import load, resolve
from ropelab.sources.hf import to_hf
from ropelab.sources.hf_archs import hf_model_class
from ropelab.sources.hf_round_trip import native_architecture
from ropelab.sources.runs import checkpoint_step
from ropelab.sources.transformers_lib import require_transformers


def _export_tokenizer(tokenizer: Tokenizer, config: RunConfig) -> HFTokenizer:
    """The run's tokenizer, tokenizers-backed: the byte tokenizer becomes its exact equivalent."""
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer = HFTokenizer(tokenizer.to_tokenizers(), tokenizer.name)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer={config.data.tokenizer!r}: {tokenizer.vocab_size} tokens but the model has only "
            f"{config.model.vocab_size}; not the run's tokenizer"
        )
    return tokenizer


def _hf_tokenizer(tokenizer: HFTokenizer, max_len: int):
    """`tokenizer` as transformers loads it, encoding as ropelab does (see the module docstring): no BOS
    named, no special tokens added."""
    from tokenizers import Tokenizer as RustTokenizer

    transformers = require_transformers("Hugging Face export")
    rust = RustTokenizer.from_str(tokenizer.tok.to_str())  # a copy: the wrapper may edit it
    if rust.encode("a").ids != rust.encode("a", add_special_tokens=False).ids:
        rust.post_processor = None
    name = lambda i: None if i is None else tokenizer.tok.id_to_token(i)  # noqa: E731
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=rust, eos_token=name(tokenizer.eos_id), pad_token=name(tokenizer.pad_id),
        model_max_length=max_len,
        # tokenizer.json does not keep this setting (the byte tokenizer's), tokenizer_config.json does
        split_special_tokens=tokenizer.tok.encode_special_tokens,
    )


def save_hf(model: Transformer, out_dir: str | Path, token_ids: dict | None = None, tokenizer=None,
            trained_context: int | None = None) -> dict:
    """Write `model` (its config is `model.config`) as a Hugging Face folder `out_dir`, no run needed.

    Route "native": the exactly equivalent transformers class, no remote code, only where the HF config
    written reads back as the same model (`ropelab.sources.hf_round_trip`).
    Route "remote_code" when there is none: ropelab's own modeling code ships in the folder with
    `auto_map` (see `remote_code`); load it with `trust_remote_code=True`. `token_ids`: bos/eos/pad
    ids for the configs (ids outside the vocabulary are dropped, None ones are written as null);
    `tokenizer`: a transformers tokenizer saved alongside; `trained_context`: config.json's
    n_positions (see the module docstring). Returns route, architecture, files, and why (no native
    class)."""
    out = refuse_existing(out_dir)
    transformers = require_transformers("Hugging Face export")
    try:
        arch, why = hf_model_class(native_architecture(model.config)), None
    except ValueError as exc:
        arch, why = None, str(exc)
    hf_model = to_hf(model) if why is None else remote_code.to_remote_hf(model)
    vocab = model.config.vocab_size
    ids = {k: v if v is not None and v < vocab else None for k, v in (token_ids or {}).items()}  # no stray ids
    for key, value in ids.items():
        setattr(hf_model.config, key, value)
    if trained_context is not None:
        hf_model.config.n_positions = trained_context
    generation = transformers.GenerationConfig(**ids)
    hf_model.generation_config = generation
    with new_folder(out) as tmp:
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


def export_hf(source: str | Path, out_dir: str | Path, layout: str = "ropelab") -> dict:
    """Write the model of `source` (a run, checkpoint or imported folder, see `ropelab.sources`) as a
    Hugging Face model folder `out_dir` (see `save_hf`).

    Returns a summary: out_dir, route ("native" | "remote_code"), architecture (HF class), checkpoint,
    step, files, tokenizer (which was saved), and why (no native class) for remote code.
    `layout` ``ropelab`` is the only one built: DeepSeek-V3's (one RoPE key shared by all heads, which an MLA
    model converted here would reach only through TransMLA's rotation of its kept pairs) is refused.
    Raises ConfigError for a non-empty `out_dir` or another layout, before loading anything."""
    if layout != "ropelab":
        raise ConfigError(f"--layout {layout}: not built; only ropelab (the native class, or ropelab's own code: an "
                          "MLA model's per-KV-head RoPE pairs and latent as they are). DeepSeek-V3's layout shares one "
                          "RoPE key over all heads, which needs TransMLA's rotation")
    out = refuse_existing(out_dir)
    require_transformers("Hugging Face export")
    found = resolve(source)
    model, tokenizer, config = load(found)
    tokenizer = _export_tokenizer(tokenizer, config)
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    info = save_hf(model, out, token_ids=ids, tokenizer=_hf_tokenizer(tokenizer, config.model.max_seq_len),
                   trained_context=trained_length(found, config))
    return {
        "out_dir": str(out),
        "route": info["route"],
        "architecture": info["architecture"],
        "checkpoint": str(found.checkpoint) if found.checkpoint else found.location,
        "step": checkpoint_step(found.checkpoint) if found.checkpoint else 0,
        "files": info["files"],
        "tokenizer": f"saved ({config.data.tokenizer}, {tokenizer.vocab_size} tokens)",
    } | ({"why": info["why"]} if "why" in info else {})


__all__ = ["export_hf", "save_hf"]
