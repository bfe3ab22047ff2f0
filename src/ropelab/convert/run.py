"""`ropelab convert`: a full-RoPE model turned into a selected-pair (partial RoPE) model folder, its
layers of one kind turned NoPE or given their own plan (`model.layer_pattern`, `model.layer_kinds`).

  convert_model(source, out_dir, overrides)   any model source -> a ropelab folder (config.yaml, a step-0
                                              checkpoint, the tokenizer, import.json, convert.json and
                                              pairs.png) that every command takes as a model source

convert.json records the plan (per layer and KV head), the 2-norm scores when used, the held-out loss of
source and converted model and the KL between them right after conversion, and what the plan saves: the
share of RoPE's rotation work (it follows the kept pairs) and the cos/sin cache bytes at the model's
context length.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional

from ropelab.config import ConfigError, ModelConfig, RunConfig
from ropelab.convert.config import LayoutConfig, convert_config
from ropelab.convert.report import pairs_heatmap
from ropelab.data.loader import PackedLoader
from ropelab.data.pipeline import build_loaders
from ropelab.data.tokenizer import HFTokenizer
from ropelab.files import refuse_existing
from ropelab.config.mla import MLAConfig
from ropelab.mla.attention import latent_cache_values
from ropelab.mla.convert import latent_model
from ropelab.model import Transformer
from ropelab.sources.calibrate import calibration_batches, held_out_check, two_norm_scores
from ropelab.sources.imported import write_imported
from ropelab.sources.loading import load, load_config
from ropelab.sources.plans import apply_plan, check_source, needs_scores, resolve_plans, target_config

RECORD = "convert.json"
HEATMAP = "pairs.png"


def _loaders(config: RunConfig, corpus: str, seq_len: int, seed: int) -> tuple[PackedLoader, PackedLoader]:
    """The corpus's train and validation loaders in the source's tokenizer (a mismatch is one line)."""
    data = dataclasses.replace(config.data, corpus=corpus, seq_len=seq_len, positions="running", pack="cross",
                               max_doc_len=None)
    try:
        train, val, _ = build_loaders(dataclasses.replace(config, data=data, seed=seed))
    except ConfigError as exc:
        raise ConfigError(f"calibration.corpus={corpus!r}: {exc}") from None
    return train, val


def with_layout(config: ModelConfig, layout: LayoutConfig) -> ModelConfig:
    """`config` with the layer kinds of `layout` (its pattern, or the source's when only kinds are given)."""
    new = copy.deepcopy(config)
    if layout.layer_pattern is not None:
        new.layer_pattern = layout.layer_pattern
    if layout.layer_kinds:
        new.layer_kinds = copy.deepcopy(layout.layer_kinds)
    new.validate()
    return new


def savings(source: Transformer, converted: Transformer) -> dict:
    """What the plan saves at the model's context length: rotated pairs (RoPE's rotation work follows
    them) and the bytes of the fp32 cos/sin tables, every distinct layer setting counted once (plans
    that differ by KV head keep no table: they form their angles per call)."""
    def pairs_rotated(model: Transformer) -> int:
        c = model.config
        return sum(block.attn.rope.rotary_dims // 2 * (c.n_head + c.kv_heads) for block in model.blocks)

    def cache(model: Transformer, seq_len: int) -> int:
        return sum(rope.table_bytes(seq_len) for rope in model.ropes)

    seq_len = source.config.max_seq_len
    before, after = pairs_rotated(source), pairs_rotated(converted)
    cache_before, cache_after = cache(source, seq_len), cache(converted, seq_len)
    return {
        "rotated_pairs": after, "rotated_pairs_source": before,
        "rope_compute_saved": 1 - after / before,
        "cache_seq_len": seq_len, "cache_bytes": cache_after, "cache_bytes_source": cache_before,
        "cache_saved": 1 - cache_after / cache_before if cache_before else 0.0,
    }


def convert_model(source: str, out_dir: str | Path, overrides=(), tree: Optional[dict] = None,
                  log=print) -> dict:
    """Convert `source` (any model source with full RoPE) to the plan of `overrides` (dotted keys of
    `ConvertConfig`, e.g. ``rope.keep_pairs=4 rope.select=2-norm calibration.tokens=262144``, or
    ``model.layer_pattern=LLLG model.layer_kinds={L: {}, G: {rope: none}}`` for NoPE every fourth layer) and
    write the folder `out_dir`. Returns convert.json's content. Every check runs before any model is loaded
    or anything is written; a ConfigError (one line) leaves nothing behind."""
    started = time.perf_counter()
    out = refuse_existing(out_dir)
    settings = convert_config(tree, overrides)
    source_config, found = load_config(source)
    model_config = source_config.model
    check_source(model_config, source)
    settings.validate(model_config.head_size)
    plan = settings.rope
    calibration = settings.calibration
    train, _ = _loaders(source_config, calibration.corpus, calibration.seq_len, calibration.seed)
    _, val = _loaders(source_config, calibration.corpus, settings.eval.seq_len, calibration.seed)
    target = with_layout(model_config, settings.model)
    if plan.keep_pairs is not None or plan.select == "list":
        target = target_config(target, plan.keep_pairs or 0, plan.select, plan.pairs)
    latent = settings.mla
    if latent.rank is not None:  # the rank against every layer's rotated channels, before anything is loaded
        dataclasses.replace(target, mla=MLAConfig(rank=latent.rank)).validate()
    loaded = load(found)
    scores = None
    if needs_scores(target):
        log(f"calibrating on {calibration.tokens:,} tokens of {calibration.corpus}")
        scores = two_norm_scores(loaded.model, calibration_batches(train, calibration.tokens, micro_batch=4))
    plans, new_config = resolve_plans(target, scores)
    keep = len(plans[0][0])
    per_kind = {} if new_config.layer_pattern is None else {"keep_pairs_per_kind": {
        new_config.kind_for_layer(layer): len(plans[layer][0]) for layer in range(len(new_config.layer_pattern))}}
    converted = apply_plan(loaded.model, new_config, plans).eval()
    if latent.rank is not None:
        converted = latent_model(converted, latent.rank, latent.init).eval()
        log(f"latent of rank {latent.rank} per KV head ({latent.init}): the cache holds "
            f"{latent_cache_values(converted)} of {latent_cache_values(loaded.model)} values per token")
    kinds = "".join(f", {kind}: {pairs}" for kind, pairs in per_kind.get("keep_pairs_per_kind", {}).items())
    log(f"kept {keep} of {model_config.head_size // 2} pairs per KV head ({plan.select}{kinds}); checking on "
        f"{settings.eval.tokens:,} held-out tokens")
    windows = math.ceil(settings.eval.tokens / settings.eval.seq_len)
    check = held_out_check(loaded.model, converted, val.sequential(windows, settings.eval.micro_batch))
    record = {
        "source": source, "kind": found.kind, "location": found.location,
        "settings": dataclasses.asdict(settings), "keep_pairs": keep, "select": plan.select, **per_kind,
        "pairs": plans, "scores": None if scores is None else [s.tolist() for s in scores],
        **check, **savings(loaded.model, converted),
        "cache_values_per_token": latent_cache_values(converted),
        "cache_values_per_token_source": latent_cache_values(loaded.model),
        "seconds": round(time.perf_counter() - started, 1),
    }
    tokenizer = loaded.tokenizer if isinstance(loaded.tokenizer, HFTokenizer) else None
    files = {RECORD: json.dumps(record, indent=1).encode(),
             HEATMAP: pairs_heatmap(plans, model_config.head_size // 2, f"{source}: {plan.select}, r = {keep}")}
    write_imported(converted, out, loaded.config.data.tokenizer, {"source": source, "kind": found.kind,
                   "converted": {"select": plan.select, "keep_pairs": keep,
                                                                    "mla": dataclasses.asdict(latent)}}, tokenizer, files)
    log(f"loss {check['loss_source']:.4f} -> {check['loss_converted']:.4f} nats/token, KL to source "
        f"{check['kl_to_source']:.4f}; RoPE work -{record['rope_compute_saved']:.1%}, cos/sin cache at "
        f"{record['cache_seq_len']:,} tokens {record['cache_bytes_source']:,} -> {record['cache_bytes']:,} bytes")
    return record | {"out_dir": str(out)}


__all__ = ["convert_model", "savings", "RECORD", "HEATMAP"]
