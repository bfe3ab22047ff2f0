"""RULER items run through a model: greedy generation, scored by `string_match_all`, and the answer's
rank by log-likelihood.

Each prompt runs once (`ropelab.evaluate.longctx_candidates.candidate_logits`): its answer candidates
are scored side by side after it, and its keys and values go on into a KV cache from which greedy
decoding emits up to the task's new tokens, stopping at an end-of-text token (the tokenizer's EOS and
the chat end markers a tokenizer has: <|im_end|>, <|eot_id|>, <|end|>, </s>). The output is decoded
and post-processed as RULER does (`ropelab.evaluate.ruler_score`). Rank: the true answer among the
candidates by summed log-probability (1 = best, ties share), as for the passkey; it shows progress in
models too small to write the answer out.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ropelab.evaluate.longctx_candidates import candidate_logits, candidate_scores, candidate_slots, rank_of_true
from ropelab.evaluate.longctx_items import items_fingerprint
from ropelab.evaluate.ruler_items import RulerItem
from ropelab.evaluate.ruler_score import postprocess, share_found, summarize_ruler_cell
from ropelab.kv_cache import KVCache

END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>")


def stop_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS and the ids of the end markers its vocabulary holds."""
    ids = {tokenizer.eos_id}
    lookup = getattr(getattr(tokenizer, "tok", None), "token_to_id", None)  # a tokenizers.Tokenizer
    if lookup is not None:
        ids |= {lookup(marker) for marker in END_MARKERS} - {None}
    return ids


@torch.no_grad()
def greedy_continuation(model, cache: KVCache, first: int, max_new_tokens: int, stops: set[int], device="cpu") -> list[int]:
    """Greedy decoding after a prompt whose keys and values are in `cache`, from its argmax `first`:
    up to `max_new_tokens` tokens, the stop token left out."""
    emitted: list[int] = []
    token = first
    while token not in stops and len(emitted) < max_new_tokens:
        emitted.append(token)
        if len(emitted) == max_new_tokens:
            break
        hidden = model.hidden_states(torch.tensor([[token]], device=device), kv_cache=cache)
        token = int(model.lm_head(hidden[:, -1]).argmax(-1))
    return emitted


def score_ruler_items(model, items: Sequence[RulerItem], tokenizer, device="cpu") -> list[dict]:
    """Greedy output, string_match_all share (in percent) and answer rank of each item, one at a time."""
    stops = stop_ids(tokenizer)
    results = []
    for item in items:
        cache = KVCache()
        slots = candidate_slots([item.candidates], tokenizer.eos_id)
        logits = candidate_logits(model, item.prompt[None], slots, device, keep=cache)  # (1, C, A + 1, V)
        rank = rank_of_true(candidate_scores(logits, slots, [item.candidates])[0].tolist())
        emitted = greedy_continuation(model, cache, int(logits[0, 0, 0].argmax()), item.max_new_tokens, stops, device)
        output = postprocess(tokenizer.decode(emitted))
        results.append({
            "index": item.index, "references": item.references, "output": output,
            "score": 100 * share_found(output, item.references), "rank": rank, "top1": rank == 1.0,
            "prompt_tokens": len(item.prompt), "haystack": item.haystack, "haystack_repeats": item.haystack_repeats,
        })
    return results


def ruler_cell(model, items: Sequence[RulerItem], tokenizer, length: int, device="cpu") -> dict:
    """The cell of one length: its items scored, their string_match_all score and answer rank."""
    results = score_ruler_items(model, [it for it in items if it.length == length], tokenizer, device)
    return {"length": length, **summarize_ruler_cell(results), "items": results}


def ruler_task_result(items: Sequence[RulerItem], cells: Sequence[dict]) -> dict:
    """A RULER task's results: its cells, and score and rank over all of its items."""
    every = [r for cell in cells for r in cell["items"]]
    return {"items_fingerprint": items_fingerprint(items), **summarize_ruler_cell(every), "cells": list(cells)}
