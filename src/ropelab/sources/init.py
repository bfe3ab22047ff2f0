"""Runs that start from another model's weights (`train.init_from`).

  run_config(base, preset, overrides)  `build_run_config`, except that with `train.init_from` set the
                                       source's model settings and tokenizer are the defaults under
                                       the user's (so a fine-tune of SmolLM2 needs no shape keys); the
                                       same with `train.branch_from` and the parent run's
  check_init(config)                   the run can start from its source: the same weight shapes and
                                       the same tokenizer; one-line ConfigError otherwise, reading
                                       only configurations and tokenizers (`check_same_weights`)
  keep_layers(state, layers)           a depth-pruned student's weights (`train.init_layers`)
  initial_weights(config)              (the source's state dict, a record of where it came from)

Settings that do not change a weight's shape may differ from the source: RoPE theta, fraction,
style and per-layer settings, attention backend, and everything outside `model`; with
`train.init_layers`, the number of layers (the run keeps those source layers, in that order). A selected-pair
plan (`model.rope.keep_pairs` / `select` / `pairs`) on a full-RoPE source converts its weights
(`initial_weights`, `ropelab.sources.plans`), and `model.mla` on a source without it draws the latent
from its keys and values (`ropelab.mla.convert`, joint SVD). A resumed run
reads its own checkpoints; `init_from` only seeds step 0.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

from ropelab.config import PLAN_KEYS, ConfigError, ModelConfig, RunConfig, build_run_config, parse_override
from ropelab.data.loader import PackedLoader
from ropelab.data.pipeline import build_loaders
from ropelab.data.tokenizer import load_tokenizer
from ropelab.mla.convert import latent_model
from ropelab.model import Transformer
from ropelab.sources.calibrate import calibration_batches, held_out_check, two_norm_scores
from ropelab.sources.loading import load, load_config
from ropelab.sources.locate import resolve
from ropelab.sources.plans import apply_plan, check_source, needs_scores, resolve_plans
from ropelab.sources.runs import checkpoint_config, is_run_dir, read_run_config
from ropelab.train.checkpoint import latest_checkpoint, step_dir

# RopeConfig fields that say which channels rotate: a run that sets one replaces the source's choice
CHANNEL_KEYS = ("fraction", "rotary_dims", *PLAN_KEYS)
# ModelConfig fields that decide the weights' names and shapes (the rest may differ from the source)
SHAPE_KEYS = ("n_layer", "d_model", "n_head", "kv_heads", "head_size", "d_ff", "vocab_size", "block", "norm",
              "mlp", "attn_bias", "mlp_bias", "qk_norm", "tie_embeddings")


def _train_setting(base: dict | None, overrides, name: str):
    """`train.<name>` as the YAML tree and the overrides give it (before the config is built)."""
    value = ((base or {}).get("train") or {}).get(name)
    for text in overrides:
        key, given = parse_override(text)
        if key == f"train.{name}":
            value = given
    return value


def _parent_config(branch_from, branch_step) -> Optional[RunConfig]:
    """The configuration the branch's parent held at the checkpoint `train.branch_from` (and
    `train.branch_step`) name: for a multi-phase parent, that phase's, as `ropelab.train.branch` checks
    it. The run's config.yaml where the checkpoint is not there yet; None where no run is named
    (`ropelab.train.branch` says what is wrong)."""
    source = Path(str(branch_from))
    run = source if is_run_dir(source) else source.parent.parent
    if not is_run_dir(run):
        return None
    if source != run:
        folder = source
    elif isinstance(branch_step, int):
        folder = step_dir(run, branch_step)
    else:  # the newest one, or a train.branch_step the config check refuses
        folder = latest_checkpoint(run) if branch_step is None else None
    try:
        return checkpoint_config(folder)[0] if folder is not None and folder.is_dir() else read_run_config(run)
    except ConfigError:
        return read_run_config(run)


def run_config(base: dict | None = None, preset: str | None = None, overrides=()) -> RunConfig:
    """A run config as `build_run_config` makes it; with `train.init_from` (or `train.branch_from`: the
    parent run's) and no model preset, the source's model settings and data.tokenizer are the defaults
    that the YAML and overrides change."""
    name = _train_setting(base, overrides, "init_from")
    branch_from = _train_setting(base, overrides, "branch_from")
    tree = copy.deepcopy(base) if base else {}
    if (name is None and branch_from is None) or preset or tree.get("preset") or (tree.get("model") or {}).get("preset"):
        return build_run_config(tree, preset, overrides)
    source_config = load_config(str(name))[0] if name is not None else _parent_config(branch_from, _train_setting(base, overrides, "branch_step"))
    if source_config is None:
        return build_run_config(tree, preset, overrides)
    model = dataclasses.asdict(source_config.model)
    mine = (tree.get("model") or {}).get("rope")
    chosen = set(mine or {}) | {key.split(".")[2] for key, _ in map(parse_override, overrides)
                                if key.startswith("model.rope.") and key.count(".") >= 2}
    if chosen & set(CHANNEL_KEYS):  # the run says which channels rotate: none of the source's say stays
        model["rope"].update({key: (1.0 if key == "fraction" else None) for key in CHANNEL_KEYS if key not in chosen})
    for key, value in (tree.get("model") or {}).items():
        model[key] = model["rope"] | value if key == "rope" and isinstance(value, dict) else value
    layers = _train_setting(tree, overrides, "init_layers")
    if isinstance(layers, list) and layers and "n_layer" not in (tree.get("model") or {}):
        model["n_layer"] = len(layers)  # a depth-pruned student: one layer per kept source layer
    tree["model"] = model
    tree.setdefault("data", {}).setdefault("tokenizer", source_config.data.tokenizer)
    return build_run_config(tree, None, overrides)


def _key(name: str) -> str:
    return f"train.init_from={name!r}"


def check_init(config: RunConfig) -> None:
    """ConfigError (one line) unless `config` can start from `train.init_from`'s weights. A vocabulary
    not set yet (it follows the tokenizer) is checked through the tokenizer, and by `initial_weights`."""
    name = config.train.init_from
    try:
        source_config, source = load_config(name)
    except ConfigError as exc:
        raise ConfigError(f"{_key(name)}: {exc}") from None
    check_layers(config, source_config.model, _key(name))
    check_same_weights(config, source_config, _key(name))


def check_layers(config: RunConfig, source: ModelConfig, key: str) -> None:
    """`train.init_layers` names layers the source has, one per layer of the run, in a source whose
    layers all share one RoPE and attention setting (so a kept layer's settings need no renumbering)."""
    layers = config.train.init_layers
    if not layers:
        return
    if any(i >= source.n_layer for i in layers):
        raise ConfigError(f"train.init_layers={layers}: the source ({key}) has layers 0..{source.n_layer - 1}")
    if len(layers) != config.model.n_layer:
        raise ConfigError(f"train.init_layers: {len(layers)} layers but model.n_layer={config.model.n_layer}; "
                          "give one source layer per layer of the run")
    if source.rope_layers or source.position_layers or source.layer_pattern:
        raise ConfigError(f"train.init_layers: the source ({key}) sets RoPE or attention per layer; keeping some of "
                          "its layers is supported only for a source whose layers are all alike")


def check_same_weights(config: RunConfig, source_config: RunConfig, key: str) -> None:
    """ConfigError (one line, starting with `key`) unless `config` has `source_config`'s weight shapes
    (`SHAPE_KEYS`; a vocabulary not set yet is left to the tokenizer) and tokenizer."""
    mine, theirs = config.model, source_config.model
    for field in SHAPE_KEYS:
        ours = getattr(mine, field)
        if (field == "vocab_size" and ours is None) or (field == "n_layer" and config.train.init_layers):
            continue
        if ours != getattr(theirs, field):
            raise ConfigError(f"{key}: model.{field}={ours!r} but the source has {getattr(theirs, field)!r}; "
                              "settings that change weight shapes must match the source")
    if theirs.mla is not None and mine.mla != theirs.mla:
        rank = None if mine.mla is None else mine.mla.rank
        raise ConfigError(f"{key}: model.mla.rank={rank} but the source is an MLA model of rank {theirs.mla.rank}; "
                          "a run from it keeps its latent's rank")
    d, s = config.data, source_config.data
    run_tokenizer = load_tokenizer(d.tokenizer, d.corpus, d.val_percent)
    source_tokenizer = load_tokenizer(s.tokenizer, s.corpus, s.val_percent)
    if run_tokenizer.fingerprint() != source_tokenizer.fingerprint():
        raise ConfigError(f"{key}: data.tokenizer={d.tokenizer!r} is not the source's tokenizer "
                          f"({s.tokenizer!r}); the weights' token ids would mean other tokens")


def keep_layers(state: dict, layers: list[int]) -> dict:
    """A state dict whose block i is the source's block `layers[i]`; embeddings, final norm and head kept."""
    kept = {}
    for name, tensor in state.items():
        if not name.startswith("blocks."):
            kept[name] = tensor
    for new, old in enumerate(layers):
        prefix = f"blocks.{old}."
        kept.update({f"blocks.{new}." + name[len(prefix):]: tensor for name, tensor in state.items()
                     if name.startswith(prefix)})
    return kept


def converts(config: RunConfig, source: ModelConfig) -> bool:
    """Whether starting `config` from `source` converts it: the run asks for a selected-pair plan
    (`ropelab.sources.plans`), for NoPE in a layer where the source has neither, or for an MLA latent
    (`model.mla`) that the source does not hold."""
    def converted(layer: int) -> bool:
        mine, theirs = config.model.rope_for_layer(layer), source.rope_for_layer(layer)
        nope = mine.resolve_dims(config.model.head_size) == 0 < theirs.resolve_dims(source.head_size)
        return (mine.has_plan and not theirs.has_plan) or nope

    latent = config.model.mla is not None and source.mla is None  # MLA from whole keys and values
    return latent or any(converted(layer) for layer in range(config.model.n_layer))


def plan_label(config: ModelConfig) -> dict:
    """{"select", "keep_pairs"} of the plan a model config asks for (its first layer's): ``nope`` and 0
    without RoPE, ``full`` and head_dim/2 with all pairs and no plan."""
    rope = config.rope_for_layer(0)
    dims = rope.resolve_dims(config.head_size)
    select = rope.select or ("list" if rope.pairs is not None else "nope" if dims == 0 else "full")
    return {"select": select, "keep_pairs": dims // 2}


def initial_weights(config: RunConfig, loaders: Optional[tuple[PackedLoader, PackedLoader]] = None) -> tuple[dict, dict]:
    """(state dict of `train.init_from`'s model, {"source", "kind", "checkpoint"} for result.json).

    When the run asks for a RoPE plan the source does not have (`converts`), the source's weights are
    converted to it: a 2-norm plan is scored on `train.calibration_tokens` tokens of the run's training
    data (`loaders` = its train and validation loaders) and written into `config.model` (so config.yaml
    records the pairs chosen), and the record gains the loss and KL to the source right after
    conversion on the validation windows the run evaluates on."""
    source = resolve(config.train.init_from)
    model = load(source).model
    if model.config.vocab_size != config.model.vocab_size:
        raise ConfigError(f"{_key(source.name)}: model.vocab_size={config.model.vocab_size} but the source has "
                          f"{model.config.vocab_size}; set model.vocab_size={model.config.vocab_size}")
    record = {"source": source.name, "kind": source.kind, "location": source.location,
              "checkpoint": str(source.checkpoint) if source.checkpoint else None}
    state = model.state_dict()
    if config.train.init_layers:
        state = keep_layers(state, config.train.init_layers)
        record["layers"] = list(config.train.init_layers)
        model = Transformer(dataclasses.replace(model.config, n_layer=len(config.train.init_layers)))
        model.load_state_dict(state)
    if not converts(config, model.config):
        return state, record
    if loaders is None:
        raise ConfigError(f"{_key(source.name)}: converting to the run's RoPE plan needs its data loaders")
    check_source(model.config, _key(source.name))
    train_loader, val_loader = loaders
    label = plan_label(config.model)
    scores = None
    if needs_scores(config.model):
        batches = calibration_batches(train_loader, config.train.calibration_tokens, config.train.micro_batch)
        scores = two_norm_scores(model, batches)
    plans, config.model = resolve_plans(config.model, scores)
    converted = apply_plan(model, dataclasses.replace(config.model, mla=None), plans).eval()
    if config.model.mla is not None:  # MHA2MLA's joint SVD (`ropelab convert` also offers svd-split)
        converted = latent_model(converted, config.model.mla.rank).eval()
        label["mla_rank"] = config.model.mla.rank
    check = held_out_check(model, converted, _check_windows(config, val_loader))
    record["conversion"] = {**label, "pairs": plans, **check}
    return converted.state_dict(), record


def _check_windows(config: RunConfig, val_loader: PackedLoader):
    """The validation windows a run evaluates on: where its distance to the source is measured."""
    windows = min(config.train.eval_batches * config.train.micro_batch, val_loader.num_windows)
    return val_loader.sequential(windows, config.train.micro_batch)


def distance_to_source(run_dir: str | Path) -> dict:
    """Mean cross-entropy of a run started from `train.init_from` and of its source, and KL(source || run),
    per token on the windows the conversion was checked on right after it (`initial_weights`), in fp32:
    where recovery has taken the run, in the same units as `init_from.conversion` in its result.json."""
    config = read_run_config(run_dir)
    if not config.train.init_from:
        raise ConfigError(f"{run_dir}: the run has no train.init_from, so no source to measure against")
    source = load(resolve(config.train.init_from)).model.float().eval()
    model = load(Path(run_dir)).model.float().eval()
    return held_out_check(source, model, _check_windows(config, build_loaders(config)[1]))


__all__ = ["run_config", "check_init", "check_layers", "check_same_weights", "keep_layers", "initial_weights",
           "converts", "plan_label", "distance_to_source", "SHAPE_KEYS"]
