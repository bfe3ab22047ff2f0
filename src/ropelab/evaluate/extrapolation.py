"""Context extension without training: each run's model under each RoPE scaling method at lengths beyond
the one it was trained at, measured by loss by position and passkey retrieval (with the answer's rank).

Per run (any model source `ropelab.sources` resolves), per method and length L:
  none      the model as trained (with its own `model.rope.scaling` if it was trained with one);
  linear, ntk, yarn, dynamic, llama3
            that method in place of the run's own scaling, on every rotating layer, with HF's default
            parameters, original_max_position = T0 and factor = L / T0, or the fixed `factor`.
T0, the base context, is what the unscaled frequencies were trained at: the run's trained length
(`ropelab.evaluate.longctx.trained_length`: data.seq_len, or max_seq_len for a model made elsewhere), or
for a run trained with a scaling that scaling's original_max_position (a run fine-tuned with YaRN x2 from
256 tokens gets YaRN x L/256 again, and at L = 512 exactly its own setting). Where a factor L / T0 would
be <= 1 every method is the unscaled model, and on a model no layer of which takes RoPE scaling (NoPE,
FoPE: the position encoding's registered type refuses it, `ropelab.config.position`) every method is the
model itself: such cells are not evaluated again but carry none's figures, marked ``same_as: none``.
`lengths` may go beyond the model's max_seq_len (the point): the cos/sin tables grow to the positions seen.

dynamic with factor f, over a window of L tokens, is static NTK at HF's grown factor f L / T0 - (f - 1):
every measurement here is one forward pass over a whole window or prompt, which HF's dynamic NTK computes
from its length (f^2 - f + 1 when f = L / T0). The passkey candidates run in a second, short pass after
their prompt (`ropelab.evaluate.longctx.candidate_logits`): under dynamic NTK their few positions past L
turn at the frequencies of L + answer length, the prompt's cached keys at L's, as in HF's generation.

Loss by position: `windows` validation windows of max(lengths) + 1 tokens (single documents where the
split has them, `position_windows`); length L reads the first L + 1 tokens of each, so every method and
length sees the same text. Per cell: bucketed means (log-spaced), the mean over the last half of the
window (positions L/2 + 1 .. L, the table's figure: at 2x the trained length exactly the positions beyond
it) and over the positions beyond the trained length. Passkey: the items of `ropelab.evaluate.longctx_items`
at each length, the same for every method, scored by `score_items` (exact match, MRR, acc@1).

`evaluate_extrapolation(runs, out_dir, ...)` checks every input first (settings, runs, validation split,
each method's scaling on each run's layers, the output folder), then evaluates run by run and writes the
reports of `ropelab.evaluate.extrapolation_report`. CLI: ``ropelab eval extrapolation RUN ... --out DIR``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ropelab import sources
from ropelab.config import ConfigError, ModelConfig, RopeScalingConfig
from ropelab.evaluate.extrapolation_report import FILES, write_reports
from ropelab.evaluate.lm_eval_report import run_labels
from ropelab.evaluate.longctx import (
    bucket_means, documents, log_buckets, loss_by_position, position_windows, progress_bar, score_items,
    summarize_cell, torch_device, trained_length, validation_split,
)
from ropelab.evaluate.longctx_items import Item, LongContextSettings, build_items, haystack_source, replace_validated
from ropelab.evaluate.longctx_report import check_out_dir

METHODS = ("none", "linear", "ntk", "yarn", "dynamic", "llama3")


@dataclass
class ExtrapolationSettings:
    """What `evaluate_extrapolation` measures; every field is also a keyword of it."""

    lengths: tuple[int, ...] = ()  # tokens; may exceed the models' max_seq_len
    methods: tuple[str, ...] = ("none", "linear", "ntk", "yarn", "dynamic")
    factor: Optional[float] = None  # every method's factor; None: L / T0 at each length L
    windows: int = 4  # loss-by-position windows
    buckets: int = 12  # log-spaced position buckets
    passkey: bool = True
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)  # passkey needle positions, 0 = start of the haystack
    items: int = 2  # passkey items per (length, depth)
    distractors: int = 9  # wrong answers the true one is ranked against
    digits: int = 5
    seed: int = 0
    batch_size: int = 4  # windows or prompts per forward pass

    def validate(self) -> "ExtrapolationSettings":
        if not self.lengths or not all(isinstance(n, int) and n >= 2 for n in self.lengths):
            raise ConfigError(f"lengths={list(self.lengths)}: give one or more context lengths, integers >= 2 tokens")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ConfigError(f"methods={','.join(self.methods)}: choose one or more of {', '.join(METHODS)} "
                              "(longrope needs per-pair factor lists, which this study does not choose)")
        for key in ("lengths", "methods"):
            if len(set(getattr(self, key))) != len(getattr(self, key)):
                raise ConfigError(f"{key}={list(getattr(self, key))}: has repeats")
        if self.factor is not None and not 1 < self.factor < float("inf"):
            raise ConfigError(f"factor={self.factor}: must be a finite number > 1 (or omitted: length / trained length)")
        for key in ("windows", "buckets", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.passkey:
            self.passkey_settings()
        return self

    def passkey_settings(self) -> LongContextSettings:
        return LongContextSettings(
            tasks=("passkey",), lengths=self.lengths, depths=self.depths, items=self.items,
            distractors=self.distractors, digits=self.digits, loss_windows=0, seed=self.seed, batch_size=self.batch_size,
        ).validate()


def make_settings(settings: Optional[ExtrapolationSettings] = None, **options: Any) -> ExtrapolationSettings:
    """`settings` (default: the defaults) with `options` replacing fields, validated."""
    return replace_validated(settings or ExtrapolationSettings(), options, "extrapolation", ("methods",))


# ------------------------------------------------------------------ scaling


def base_context(config, trained: int) -> int:
    """T0: the context the model's unscaled frequencies were trained at."""
    own = config.model.rope.scaling
    return own.original_max_position if own is not None and own.original_max_position else trained


def rotates(model_config: ModelConfig) -> bool:
    """Whether a scaling method changes any layer: one whose position encoding takes RoPE scaling (its
    registered type declares no refusal, `ropelab.config.position`: not NoPE, not FoPE)."""
    return any(model_config.positions_for_layer(layer)[0].type.extrapolation is None
               for layer in range(model_config.n_layer))


def scaling_refusal(model_config: ModelConfig) -> Optional[str]:
    """Why no scaling method changes the model, naming its position encoding; None where one does."""
    if rotates(model_config):
        return None
    named = list({position.type.name: position.type for layer in range(model_config.n_layer)
                  for position in model_config.positions_for_layer(layer)}.values())  # every layer's, once
    named = [kind for kind in named if kind.name != "nope"] or named  # ALiBi's layers rotate nothing: name ALiBi
    return (f"{' + '.join(kind.label for kind in named)}: every method is the model itself; "
            + "; ".join(kind.extrapolation for kind in named if kind.extrapolation))


def scaled_config(model_config: ModelConfig, scaling: RopeScalingConfig, where: str) -> ModelConfig:
    """A copy of `model_config` whose rotating layers all use `scaling`, checked on each layer's own
    spectrum (ConfigError naming `where` and the key); NoPE layers keep none (`Transformer.set_rope_scaling`),
    and so do layers whose rotation declares a refusal (`keep_unscaled`)."""
    config = copy.deepcopy(model_config)
    config.rope.scaling = scaling
    kinds = [kind.rope for kind in config.layer_kinds.values() if isinstance(kind.rope, dict)]
    lists = [config.position or [], *(kind.position or [] for kind in config.layer_kinds.values()),
             *config.position_layers.values()]
    for override in [*config.rope_layers.values(), *kinds, *(entry for entries in lists for entry in entries)]:
        if "scaling" in override:
            override["scaling"] = dataclasses.asdict(scaling)
    for layer in range(config.n_layer):
        refused = config.positions_for_layer(layer)[0].type.extrapolation is not None
        if refused and config.rope_for_layer(layer).resolve_dims(config.head_size):
            keep_unscaled(config, layer)
    try:
        for layer in range(config.n_layer):
            rope = config.rope_for_layer(layer)
            if rope.resolve_dims(config.head_size):
                rope.validate(config.head_size)
        if config.mla is not None:  # a latent cache takes static scalings only (`ropelab.config.mla`)
            config.mla.validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return config


def keep_unscaled(config: ModelConfig, layer: int) -> None:
    """No RoPE scaling on `layer`, whose rotation declares it takes none (FoPE in a layer's or a kind's own
    list while other layers rotate), set where the layer's RoPE keys are spelled: its own position list's
    rotation entry, else its `model.rope_layers` entry."""
    own = config.layer_entry("position_layers", layer)
    if own is not None:
        entry = next(entry for entry in own if entry["type"] == config.positions_for_layer(layer)[0].type.name)
        entry["scaling"] = None
        return
    key = next((key for key in (layer, str(layer)) if key in config.rope_layers), layer)
    config.rope_layers[key] = dict(config.rope_layers.get(key) or {}) | {"scaling": None}


@dataclass
class Cell:
    method: str
    length: int
    factor: Optional[float]
    model_config: Optional[ModelConfig]  # None: the cell is none's at this length (`same_as`)


def plan_cells(run: str, model_config: ModelConfig, base: int, settings: ExtrapolationSettings) -> list[Cell]:
    """Every (method, length) of a run, length-major, none first; the scaled model config of each."""
    methods = ["none", *(m for m in settings.methods if m != "none")]
    own = copy.deepcopy(model_config)
    cells = []
    for length in settings.lengths:
        factor = settings.factor if settings.factor is not None else length / base
        for method in methods:
            if method == "none":
                cells.append(Cell(method, length, None, own))
            elif factor <= 1 or not rotates(model_config):
                cells.append(Cell(method, length, None, None))
            else:
                scaling = RopeScalingConfig(method=method, factor=float(factor), original_max_position=base)
                cells.append(Cell(method, length, factor, scaled_config(model_config, scaling,
                                                                        f"{run}: methods={method} at {length} tokens")))
    return cells


# ------------------------------------------------------------------ runs


@dataclass
class _Run:
    path: str
    label: str
    config: Any
    source: Any
    tokenizer: Any
    validation: Any  # TokenSplit
    trained: int
    base: int
    cells: list[Cell]
    items: list[Item]


def _prepare(run: str, label: str, settings: ExtrapolationSettings) -> _Run:
    """Everything about one run that can be checked without its weights; ConfigError on any problem."""
    config, source = sources.load_config(run)
    tokenizer, validation = validation_split(run, config)
    need = max(settings.lengths) + 1
    starts, _ = documents(validation)
    if not np.any(starts + need <= validation.num_tokens):
        raise ConfigError(f"{run}: lengths up to {need - 1} need windows of {need} validation tokens from a document "
                          f"start; the split has {validation.num_tokens} tokens")
    trained = trained_length(source, config)
    base = base_context(config, trained)
    cells = plan_cells(run, config.model, base, settings)
    items = []
    if settings.passkey:
        passkey = settings.passkey_settings()
        items = build_items(tokenizer, "passkey", haystack_source(tokenizer, "passkey", validation, need), passkey)
    return _Run(run, label, config, source, tokenizer, validation, trained, base, cells, items)


def _measure(model, run: _Run, windows: np.ndarray, length: int, settings: ExtrapolationSettings, device) -> tuple[dict, np.ndarray]:
    per_position = loss_by_position(model, windows[:, : length + 1], settings.batch_size, device)
    figures: dict[str, Any] = {
        "loss_last_half": float(per_position[length // 2:].mean()),
        "loss_beyond_train_len": float(per_position[run.trained:].mean()) if length > run.trained else None,
        "buckets": bucket_means(per_position, log_buckets(length, settings.buckets)),
    }
    if run.items:
        same_length = [it for it in run.items if it.length == length]
        scored = score_items(model, same_length, run.tokenizer.decode, run.tokenizer.eos_id, settings.batch_size, device)
        figures["passkey"] = summarize_cell(scored)
    return figures, per_position


def _evaluate_run(run: _Run, settings: ExtrapolationSettings, device: torch.device, progress, task_id) -> dict:
    started = time.time()
    model = sources.load(run.source).model.to(device)
    windows, single = position_windows(run.validation, max(settings.lengths), settings.windows, settings.seed)
    config = run.config
    own = config.model.rope.scaling
    entry: dict[str, Any] = {
        "label": run.label, "run": run.path, "checkpoint": str(run.source.checkpoint or run.source.location),
        "rope_theta": config.model.rope.theta, "rotary_dims": config.model.rope.resolve_dims(config.model.head_size),
        "head_dim": config.model.head_size, "rotates": rotates(config.model),
        "scaling_refused": scaling_refusal(config.model), "train_seq_len": run.trained,
        "base_context": run.base, "own_scaling": dataclasses.asdict(own) if own is not None else None,
        "windows": len(windows), "single_document_windows": single, "loss_at_train_len": None, "cells": [],
    }
    none: dict[int, dict] = {}
    for cell in run.cells:
        progress.update(task_id, description=f"{run.label} {cell.method} {cell.length} tokens")
        if cell.model_config is None:
            figures = {**none[cell.length], "same_as": "none"}
        else:
            model.set_rope_scaling(cell.model_config)
            figures, per_position = _measure(model, run, windows, cell.length, settings, device)
            if cell.method == "none":
                none[cell.length] = figures
                if entry["loss_at_train_len"] is None and cell.length >= run.trained:  # positions T/2 + 1 .. T
                    entry["loss_at_train_len"] = float(per_position[run.trained // 2: run.trained].mean())
        entry["cells"].append({"method": cell.method, "length": cell.length, "factor": cell.factor, **figures})
        progress.advance(task_id)
    entry["seconds"] = round(time.time() - started, 2)
    return entry


def evaluate_extrapolation(
    runs: Sequence[str | Path],
    out_dir: str | Path,
    settings: Optional[ExtrapolationSettings] = None,
    *,
    device: Optional[str] = None,
    progress: bool = True,
    **options: Any,
) -> dict:
    """Loss by position (and passkey retrieval) of each run under each RoPE scaling method at each length.
    `options` override fields of `settings` (`ExtrapolationSettings`; `lengths` has no default). Writes
    extrapolation.json, extrapolation.md and loss_by_position.png into `out_dir` and returns the
    extrapolation.json content."""
    settings = make_settings(settings, **options)
    if not runs:
        raise ConfigError("runs: give one or more model sources")
    check_out_dir(out_dir, FILES, "extrapolation")
    target = torch_device(device)
    labels = run_labels([str(r) for r in runs])
    prepared = [_prepare(str(r), label, settings) for r, label in zip(runs, labels)]
    entries = []
    with progress_bar(progress, "extrapolation") as bar:
        task_id = bar.add_task("", total=sum(len(run.cells) for run in prepared))
        for run in prepared:
            entries.append(_evaluate_run(run, settings, target, bar, task_id))
    results = {"settings": dataclasses.asdict(settings), "runs": entries}
    write_reports(results, out_dir)
    return results


__all__ = ["METHODS", "ExtrapolationSettings", "make_settings", "base_context", "rotates", "scaled_config", "scaling_refusal",
           "plan_cells", "evaluate_extrapolation"]
