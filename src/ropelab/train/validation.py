"""The validation loss the trainer logs, the same figure on any number of data-parallel ranks."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ropelab.config import RunConfig
from ropelab.data.loader import PackedLoader
from ropelab.train.autocast import autocast
from ropelab.train.distributed import DistEnv


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, loader: PackedLoader, config: RunConfig, device: torch.device,
                  env: Optional[DistEnv] = None) -> float:
    """Mean validation loss per labelled token over the first `eval_batches` x `micro_batch` windows,
    split across the data-parallel ranks (rank r takes windows r, r + world, ...), so that the figure
    does not depend on the world size. Every rank runs the same number of forwards (FSDP's are
    collective); a rank with fewer windows repeats its first micro-batch without counting it."""
    env = env or DistEnv()
    micro, use_doc_ids = config.train.micro_batch, config.attention.doc_mask
    windows = min(config.train.eval_batches * micro, loader.num_windows)
    mine = list(loader.sequential(windows, micro, env.rank, env.world))
    rounds = math.ceil(math.ceil(windows / env.world) / micro)  # rank 0's count, the largest
    filler = mine[0] if mine else loader.collate([0])
    model.eval()
    total, tokens = 0.0, 0
    for i in range(rounds):
        batch = (mine[i] if i < len(mine) else filler).to(device)
        with autocast(config, device):
            _, loss = model(batch.input_ids, batch.labels, batch.position_ids, batch.doc_ids if use_doc_ids else None)
        labelled = int((batch.labels != -100).sum())
        if i < len(mine) and labelled:
            total += loss.item() * labelled
            tokens += labelled
    model.train()
    total, tokens = env.sum([total, tokens], device)
    return total / tokens
