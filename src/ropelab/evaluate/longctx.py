"""Long-context evaluation: passkey retrieval, needle in a haystack, RULER's synthetic tasks, and loss
by position.

Retrieval tasks and their items: `ropelab.evaluate.longctx_items`; RULER's tasks: their items
`ropelab.evaluate.ruler_items`, run and scored by `ropelab.evaluate.ruler_eval` (greedy generation,
`string_match_all`, answer rank), with the average per length and the effective length of
`ropelab.evaluate.ruler_score`.

Scores per item:
  exact match  greedy decoding gives the answer and then no further digit. Greedy decoding is read off
               the teacher-forced pass over the true answer: until its first wrong token it is exactly
               what token-by-token greedy decoding (no KV cache) produces, and that token settles the
               item, so no separate generation pass is run. A greedy output that spells the answer with
               other tokens than the tokenizer's own encoding counts as a miss.
  rank         the true answer against `distractors` random answers of the same format, by summed
               log-probability given the prompt: 1 = best, ties share (rank = 1 + better + ties / 2).
               Reported as mean reciprocal rank (mrr) and accuracy@1 (strictly best); they show
               progress in small models that cannot generate the answer yet.
Prompts of one length run `batch_size` at a time, each prompt's candidates side by side in one short
row after it (`ropelab.evaluate.longctx_candidates`): about one pass of `length` tokens per item.

Loss by position: `loss_windows` windows of loss_length + 1 validation tokens, each starting at a
document start, picked by seed among documents at least that long; when there are too few, the rest
start at other documents and run on through the packed stream (results count the single-document
windows). Token losses are averaged per position over windows, then over log-spaced position buckets.

`evaluate_longctx(run_dirs, out_dir, ...)` checks every input first (runs, lengths against each
model's max_seq_len unless the model sets RoPE scaling, validation split sizes, the output folder),
then evaluates run by run and writes the reports of `ropelab.evaluate.longctx_report`. CLI:
``ropelab eval longctx RUN ... --out DIR``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ropelab import sources
from ropelab.config import ConfigError
from ropelab.data.pipeline import open_token_folder, token_folder
from ropelab.data.tokenizer import load_tokenizer
from ropelab.data.tokens import open_split
from ropelab.evaluate.lm_eval_report import run_labels
from ropelab.evaluate.longctx_report import check_out_dir, write_reports
from ropelab.evaluate.longctx_candidates import candidate_logits, candidate_scores, candidate_slots, rank_of_true
from ropelab.evaluate.longctx_items import (
    WINDOW_PLACES, Item, LongContextSettings, build_items, haystack_source, items_fingerprint, make_settings,
)
from ropelab.evaluate.ruler_eval import ruler_cell, ruler_task_result
from ropelab.evaluate.ruler_essay import essay_text
from ropelab.evaluate.ruler_items import bos_description, build_ruler_items
from ropelab.evaluate.ruler_score import ruler_summary
from ropelab.evaluate.ruler_tasks import ESSAY_TASKS, RULER_TASKS
from ropelab.evaluate.trained_context import trained_length

# ------------------------------------------------------------------ scoring


def greedy_along(answer: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """What greedy decoding emits, given the argmax after each prefix of the true answer (len(answer) + 1
    of them): the argmaxes up to and including the first that leaves the answer (or the one after it)."""
    emitted = []
    for k, token in enumerate(argmax):
        emitted.append(int(token))
        if k == len(answer) or token != answer[k]:
            break
    return emitted


def score_items(model, items: Sequence[Item], decode, pad_id: int, batch_size: int = 8, device="cpu") -> list[dict]:
    """Rank, exact match and greedy output of each item; items of one length, `batch_size` prompts per pass."""
    results = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        candidates = [item.candidates for item in chunk]
        slots = candidate_slots(candidates, pad_id)
        logits = candidate_logits(model, np.stack([item.prompt for item in chunk]), slots, device)  # (N, C, A + 1, V)
        scores = candidate_scores(logits, slots, candidates)  # (N, C)
        greedy = logits[:, 0].argmax(-1).cpu()  # (N, A + 1), along the true answer
        for n, item in enumerate(chunk):
            answer = item.candidates[0]
            emitted = greedy_along(answer, greedy[n, : len(answer) + 1].tolist())
            exact = len(emitted) == len(answer) + 1 and not decode(emitted[-1:])[:1].isdigit()
            rank = rank_of_true(scores[n].tolist())
            results.append({
                "index": item.index, "answer": item.answer, "generated": decode(emitted), "exact_match": bool(exact),
                "rank": rank, "top1": rank == 1.0, "needle_at": item.needle_at,
            })
    return results


def summarize_cell(results: Sequence[dict]) -> dict:
    return {
        "exact_match": float(np.mean([r["exact_match"] for r in results])),
        "mrr": float(np.mean([1.0 / r["rank"] for r in results])),
        "acc_at_1": float(np.mean([r["top1"] for r in results])),
        "mean_rank": float(np.mean([r["rank"] for r in results])),
    }


# ------------------------------------------------------------------ loss by position


def log_buckets(length: int, count: int) -> np.ndarray:
    """Edges e_0 = 1 < ... < e_k = length + 1 of log-spaced buckets [e_j, e_j+1) over positions 1..length."""
    edges = np.unique(np.round(np.geomspace(1, length + 1, count + 1)).astype(np.int64))
    edges[0], edges[-1] = 1, length + 1
    return edges


def documents(split) -> tuple[np.ndarray, np.ndarray]:
    """(first stream position, length) of every document of a `TokenSplit`."""
    starts = [np.asarray(s.doc_offsets[:-1], dtype=np.int64) + base for s, base in zip(split.shards, split.token_bases)]
    lengths = [np.diff(np.asarray(s.doc_offsets, dtype=np.int64)) for s in split.shards]
    return np.concatenate(starts), np.concatenate(lengths)


def position_windows(split, length: int, count: int, seed: int, place: str = "start") -> tuple[np.ndarray, int]:
    """(count, length + 1) validation token windows, and how many lie in one document.

    ``start``: windows start at document starts, long documents first (then windows that run on through
    the packed stream), so that position p has the document's first p tokens before it. ``inside``:
    windows at distinct random offsets inside documents of at least length + 1 tokens (every offset
    equally likely), so that a few long documents give many windows and what a position holds does not
    depend on where documents begin (a play's title page, a file's imports); every window lies in one
    document, and too few long documents is a ConfigError."""
    starts, lengths = documents(split)
    long_docs = np.flatnonzero(lengths >= length + 1)
    rng = np.random.default_rng([seed, 0])
    if place not in WINDOW_PLACES:
        raise ConfigError(f"loss_place={place!r}: choose one of {', '.join(WINDOW_PLACES)}")
    if place == "inside":
        offsets_per_doc = lengths[long_docs] - length  # window starts that stay inside each long document
        ends = np.cumsum(offsets_per_doc)  # the window starts of documents 0..d, counted together
        total = int(offsets_per_doc.sum())
        if total < count:
            raise ConfigError(f"loss by position: the validation split has {total} window starts "
                              f"inside documents of at least {length + 1} tokens, fewer than the {count} windows asked for")
        picks = rng.choice(total, size=count, replace=False)
        doc_of = np.searchsorted(ends, picks, side="right")
        first = starts[long_docs[doc_of]] + picks - (ends - offsets_per_doc)[doc_of]
        return np.stack([split.tokens(int(f), int(f) + length + 1) for f in first]), count
    fits = np.flatnonzero(starts + length + 1 <= split.num_tokens)
    chosen = list(rng.permutation(long_docs)[:count])
    chosen += list(rng.permutation(np.setdiff1d(fits, chosen))[: count - len(chosen)])
    windows = np.stack([split.tokens(starts[d], starts[d] + length + 1) for d in chosen])
    return windows, min(len(long_docs), count)


@torch.no_grad()
def loss_by_position(model, windows: np.ndarray, batch_size: int, device="cpu", chunk: int = 1024) -> np.ndarray:
    """Mean next-token loss at each position 1..L of (N, L + 1) windows, over windows: shape (L,)."""
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for start in range(0, len(windows), batch_size):
        batch = torch.from_numpy(windows[start : start + batch_size]).to(device)
        hidden = model.hidden_states(batch[:, :-1])
        for p in range(0, hidden.shape[1], chunk):  # logits of a few positions at a time: (B, chunk, V)
            logits = model.lm_head(hidden[:, p : p + chunk]).float()
            targets = batch[:, 1 + p : 1 + p + chunk]
            losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            total[p : p + chunk] += losses.sum(0).double().cpu()
    return (total / len(windows)).numpy()


def bucket_means(per_position: np.ndarray, edges: np.ndarray) -> list[dict]:
    """Mean of per-position losses (positions 1..L) in each bucket [start, end)."""
    return [
        {"start": int(a), "end": int(b), "loss": float(per_position[a - 1 : b - 1].mean())}
        for a, b in zip(edges[:-1], edges[1:])
    ]


# ------------------------------------------------------------------ runs


@dataclass
class _Run:
    path: str
    label: str
    config: Any
    tokenizer: Any
    validation: Any  # TokenSplit; None when neither the needle nor loss by position needs it
    items: dict[str, list]  # Item or RulerItem


def validation_split(run: str, config) -> tuple[Any, Any]:
    """(tokenizer, validation `TokenSplit`) of a run's data config; ConfigError when the split is empty."""
    data = config.data
    tokenizer = load_tokenizer(data.tokenizer, data.corpus, data.val_percent)
    folder = token_folder(config)
    manifest = open_token_folder(folder, "sizes")
    if not manifest["splits"]["validation"]["tokens"]:
        raise ConfigError(f"{run}: the validation split of {folder} is empty (data.corpus={data.corpus!r})")
    return tokenizer, open_split(folder, "validation", manifest)


def torch_device(name: Optional[str]) -> torch.device:
    if name and name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def length_limit(model_config) -> float:
    """The most positions a prompt may take: the model's max_seq_len, or none where every layer has RoPE
    scaling or an encoding declared to run at any length (`any_length`: ALiBi), both meant to run past it."""
    layers = range(model_config.n_layer)
    scaled = any(model_config.rope_for_layer(layer).scaling is not None for layer in layers)
    any_length = all(any(entry.type.any_length for entry in model_config.positions_for_layer(layer)) for layer in layers)
    return float("inf") if scaled or any_length else model_config.max_seq_len


def _prepare(run: str, label: str, settings: LongContextSettings, cache: dict) -> _Run:
    """Everything about one run that can be checked without its weights; ConfigError on any problem."""
    config, _ = sources.load_config(run)  # of the checkpoint's phase: its theta and training length
    data = config.data
    key = (data.tokenizer, data.corpus, data.val_percent)
    if key not in cache:
        if "needle" in settings.tasks or settings.loss_tokens:
            tokenizer, validation = validation_split(run, config)
        else:
            tokenizer, validation = load_tokenizer(data.tokenizer, data.corpus, data.val_percent), None
        items = {}
        for task in settings.tasks:
            if task in RULER_TASKS:
                items[task] = build_ruler_items(tokenizer, task, settings.lengths, settings.items, settings.seed,
                                                settings.distractors, settings.haystack)
                for length in sorted({it.length for it in items[task] if it.haystack_repeats}):
                    print(f"ropelab: warning: {task} at {length} tokens: the essay haystack {settings.haystack} runs "
                          "out of text and repeats it", file=sys.stderr)
            else:
                source = haystack_source(tokenizer, task, validation, max(settings.lengths))
                items[task] = build_items(tokenizer, task, source, settings)
        cache[key] = (tokenizer, validation, items)
    tokenizer, validation, items = cache[key]
    longest = max(it.positions for task_items in items.values() for it in task_items)
    limit = length_limit(config.model)
    if longest > limit:
        raise ConfigError(
            f"{run}: prompts of up to {max(settings.lengths)} tokens plus the answer need {longest} positions, "
            f"beyond the model's max_seq_len {limit}; use lengths up to {limit - (longest - max(settings.lengths))} "
            "or a model with RoPE scaling (model.rope.scaling)"
        )
    if settings.loss_tokens > limit:
        raise ConfigError(f"{run}: loss_length {settings.loss_tokens} is beyond the model's max_seq_len {limit}")
    if settings.loss_tokens and settings.loss_tokens + 1 > validation.num_tokens:
        raise ConfigError(
            f"{run}: loss_length {settings.loss_tokens} needs {settings.loss_tokens + 1} validation tokens, "
            f"the split has {validation.num_tokens}"
        )
    return _Run(str(run), label, config, tokenizer, validation, items)


def progress_bar(enabled: bool, title: str = "longctx"):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(f"[bold]{title}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        disable=not enabled,
    )


def _depth_cells(model, items: Sequence[Item], settings: LongContextSettings, tokenizer, device) -> list[dict]:
    """The (length, depth) cells of passkey or needle items of one length."""
    scored = score_items(model, items, tokenizer.decode, tokenizer.eos_id, settings.batch_size, device)
    cells = []
    for depth in settings.depths:
        results = [r for it, r in zip(items, scored) if it.depth == depth]
        cells.append({"length": items[0].length, "depth": depth, **summarize_cell(results), "items": results})
    return cells


def _evaluate_run(run: _Run, settings: LongContextSettings, device: torch.device, progress, task_id) -> dict:
    started = time.time()
    source = sources.resolve(run.path)
    model = sources.load(source).model.to(device)
    tokenizer, config = run.tokenizer, run.config
    entry: dict[str, Any] = {
        "label": run.label, "run": run.path, "checkpoint": str(source.checkpoint or source.location),
        "rope_theta": config.model.rope.theta, "rotary_dims": model.ropes[0].rotary_dims,
        "head_dim": config.model.head_size, "train_seq_len": trained_length(source, config),
        "max_seq_len": config.model.max_seq_len, "tokenizer": config.data.tokenizer, "tasks": {},
    }
    for task, items in run.items.items():
        cells = []
        for length in settings.lengths:
            progress.update(task_id, description=f"{run.label} {task} {length} tokens")
            if task in RULER_TASKS:
                cells.append(ruler_cell(model, items, tokenizer, length, device))
            else:
                cells += _depth_cells(model, [it for it in items if it.length == length], settings, tokenizer, device)
            progress.advance(task_id)
        if task in RULER_TASKS:
            entry["tasks"][task] = ruler_task_result(items, cells)
        else:
            every = [r for cell in cells for r in cell["items"]]
            entry["tasks"][task] = {"items_fingerprint": items_fingerprint(items), **summarize_cell(every), "cells": cells}
    ruler = [task for task in settings.tasks if task in RULER_TASKS]
    if ruler:
        repeats = sorted({(it.task, it.length) for task in ruler for it in run.items[task] if it.haystack_repeats})
        entry["ruler"] = {**ruler_summary(entry["tasks"], ruler, settings.threshold), "bos": bos_description(tokenizer),
                          "haystack_repeats": [{"task": task, "length": length} for task, length in repeats]}
    if settings.loss_tokens:
        progress.update(task_id, description=f"{run.label} loss by position")
        windows, single = position_windows(run.validation, settings.loss_tokens, settings.loss_windows, settings.seed,
                                          settings.loss_place)
        per_position = loss_by_position(model, windows, settings.batch_size, device)
        train_len = config.data.seq_len
        entry["loss_by_position"] = {
            "length": settings.loss_tokens, "windows": len(windows), "single_document_windows": single,
            "place": settings.loss_place,
            "buckets": bucket_means(per_position, log_buckets(settings.loss_tokens, settings.loss_buckets)),
            "loss_within_train_len": float(per_position[:train_len].mean()),
            "loss_beyond_train_len": float(per_position[train_len:].mean()) if settings.loss_tokens > train_len else None,
        }
        progress.advance(task_id)
    entry["seconds"] = round(time.time() - started, 2)
    return entry


def evaluate_longctx(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    settings: Optional[LongContextSettings] = None,
    *,
    device: Optional[str] = None,
    progress: bool = True,
    **options: Any,
) -> dict:
    """Passkey and needle retrieval over lengths x depths, RULER's tasks over lengths, and loss by
    position, for each run (run dir, checkpoint or imported folder). `options` override fields of
    `settings` (`LongContextSettings`).
    Writes longctx.json, longctx.md, longctx_heatmap.png and loss_by_position.png into `out_dir` and
    returns the longctx.json content."""
    settings = make_settings(settings, **options)
    if not run_dirs:
        raise ConfigError("no run given")
    check_out_dir(out_dir)
    target = torch_device(device)
    labels = run_labels([str(r) for r in run_dirs])
    cache: dict = {}
    runs = [_prepare(str(r), label, settings, cache) for r, label in zip(run_dirs, labels)]

    steps = len(settings.tasks) * len(settings.lengths) + (1 if settings.loss_tokens else 0)
    entries = []
    with progress_bar(progress) as bar:
        task_id = bar.add_task("", total=steps * len(runs))
        for run in runs:
            entries.append(_evaluate_run(run, settings, target, bar, task_id))
    results = {"settings": dataclasses.asdict(settings), "runs": entries}
    if any(task in ESSAY_TASKS for task in settings.tasks):
        essay = essay_text(settings.haystack)
        results["haystack"] = {"name": essay.name, "description": essay.description}
    write_reports(results, out_dir)
    return results


__all__ = [
    "greedy_along", "score_items", "length_limit",
    "summarize_cell", "log_buckets", "documents", "position_windows", "loss_by_position", "bucket_means",
    "validation_split", "torch_device", "progress_bar", "trained_length", "evaluate_longctx",
]
