"""A RoPE plan and data: the 2-norm calibration that chooses pairs, and the check right after conversion.

  calibration_batches(loader, tokens, micro_batch)
                                       the calibration windows, deterministic for the loader's seed
  two_norm_scores(model, batches)      per layer, MHA2MLA's score of every pair of every KV head
  held_out_check(source, converted, batches)
                                       both models' loss and KL(source || converted) per token

The 2-norm calibration reads each pre-RoPE query and key pair's mean L2 norm, per layer.
The query and key of a head are read where they enter RoPE (after QK-Norm when the model has it),
through forward hooks on each attention layer's `q_norm` / `k_norm` (an identity without QK-Norm), so
nothing is stored but running sums.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from ropelab.data.loader import Batch, PackedLoader
from ropelab.model import Transformer
from ropelab.rope.pairs import pair_norms, pair_scores


def calibration_batches(loader: PackedLoader, tokens: int, micro_batch: int) -> Iterator[Batch]:
    """The first `tokens` (rounded up to whole windows) of `loader`'s sampled order, in micro-batches."""
    windows = loader.sample_windows(0, math.ceil(tokens / loader.seq_len))
    for start in range(0, len(windows), micro_batch):
        yield loader.collate(windows[start: start + micro_batch])


@torch.no_grad()
def pair_norm_means(model: Transformer, batches: Iterable[Batch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (q (H, n_pairs), k (K, n_pairs)): the mean over the batches' tokens of each pre-RoPE
    pair's L2 norm."""
    c = model.config
    sums = [[torch.zeros(c.n_head, c.head_size // 2, dtype=torch.float64),
             torch.zeros(c.kv_heads, c.head_size // 2, dtype=torch.float64)] for _ in range(c.n_layer)]
    tokens = 0

    def hook(layer: int, which: int, layout: str):
        def record(module, inputs, output):  # output (B, T, heads, D)
            sums[layer][which] += pair_norms(output.transpose(1, 2), layout).cpu()
        return record

    handles = []
    for layer, block in enumerate(model.blocks):
        layout = c.rope_for_layer(layer).layout
        handles.append(block.attn.q_norm.register_forward_hook(hook(layer, 0, layout)))
        handles.append(block.attn.k_norm.register_forward_hook(hook(layer, 1, layout)))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for batch in batches:
            model.hidden_states(batch.input_ids.to(device), batch.position_ids.to(device))
            tokens += batch.input_ids.numel()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return [(q / tokens, k / tokens) for q, k in sums]


def two_norm_scores(model: Transformer, batches: Iterable[Batch]) -> list[torch.Tensor]:
    """Per layer, MHA2MLA's 2-norm score of every pair of every KV head, (K, n_pairs)."""
    return [pair_scores(q, k) for q, k in pair_norm_means(model, batches)]


@torch.no_grad()
def held_out_check(source: Transformer, converted: Transformer, batches: Iterable[Batch]) -> dict:
    """Mean cross-entropy of both models and KL(source || converted), per labelled token."""
    totals = {"loss_source": 0.0, "loss_converted": 0.0, "kl_to_source": 0.0}
    tokens = 0
    for batch in batches:
        mask = batch.labels != -100
        logp = [F.log_softmax(m(batch.input_ids, position_ids=batch.position_ids)[0].float(), -1)[mask]
                for m in (source, converted)]
        targets = batch.labels[mask]
        totals["loss_source"] += float(F.nll_loss(logp[0], targets, reduction="sum"))
        totals["loss_converted"] += float(F.nll_loss(logp[1], targets, reduction="sum"))
        totals["kl_to_source"] += float(F.kl_div(logp[1], logp[0], log_target=True, reduction="sum"))
        tokens += int(mask.sum())
    return {key: value / tokens for key, value in totals.items()} | {"tokens": tokens}


__all__ = ["calibration_batches", "pair_norm_means", "two_norm_scores", "held_out_check"]
