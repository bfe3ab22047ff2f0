"""Training objectives, in one call shape so that the trainer treats every loss alike:

    loss, figures = objective(model, batch, autocast_ctx)

`loss` is the differentiable mean over the batch's labelled tokens; `figures` are floats for the
metrics log: {"ce"} for cross-entropy, plus {"kd"} when a teacher is given, plus "z_loss" (the mean
squared log-normaliser, unweighted) when `train.z_loss` is on. Every objective runs the chunked
`ropelab.train.loss.kd_loss`, so none materialises (tokens x vocab) logits for a whole window.
`autocast_ctx` is optional: the trainer may enter its autocast around the call instead.

The trainer knows cross-entropy only. A feature that trains with another loss registers a builder
for its configuration section (`register_objective("distill", ...)` is what importing
`ropelab.distill` does); `build_objective` picks it when the run's config has that section.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ropelab.config import ConfigError, RunConfig
from ropelab.data.loader import Batch
from ropelab.train.distributed import unwrap
from ropelab.train.loss import kd_loss

# objective(model, batch) -> (loss to backpropagate, floats to log); the model is the wrapped one
Objective = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict]]
# builder(phase config, device, the previous phase's objective or None) -> the phase's objective
ObjectiveBuilder = Callable[[RunConfig, torch.device, Optional[Objective]], Objective]

_BUILDERS: dict[str, ObjectiveBuilder] = {}


class ChunkedObjective:
    """The chunked head loss: KD from `source` mixed with cross-entropy (weight `alpha` on KD), or
    cross-entropy alone when `source` is None. `source` is anything with
    ``targets(input_ids, position_ids, doc_ids, out_device)`` (a teacher, or a cache of its targets).

    `use_doc_mask`: pass the batch's document ids to the model and the source (`attention.doc_mask`).
    `z_loss`: weight of PaLM's logsumexp^2 regulariser (`train.z_loss`)."""

    def __init__(self, source=None, temperature: float = 1.0, alpha: float = 0.0, top_k: Optional[int] = None,
                 chunk_tokens: int = 4096, use_doc_mask: bool = False, z_loss: float = 0.0):
        self.source = source
        self.temperature, self.alpha, self.top_k, self.chunk_tokens = temperature, alpha, top_k, chunk_tokens
        self.use_doc_mask = use_doc_mask
        self.z_loss = z_loss

    def __call__(self, model, batch: Batch, autocast_ctx=None) -> tuple[torch.Tensor, dict[str, float]]:
        doc_ids = batch.doc_ids if self.use_doc_mask else None
        targets = None
        if self.source is not None:
            targets = self.source.targets(batch.input_ids, batch.position_ids, doc_ids, out_device=batch.input_ids.device)
        with autocast_ctx if autocast_ctx is not None else contextlib.nullcontext():
            # through forward, so that DDP's and FSDP's hooks run; the head is applied chunk by chunk
            hidden, _ = model(batch.input_ids, None, batch.position_ids, doc_ids, return_hidden=True)
            out = kd_loss(hidden, unwrap(model).lm_head, batch.labels, targets, self.temperature, self.alpha,
                          self.top_k, self.chunk_tokens, self.z_loss)
        figures = {"ce": out.ce.item()}
        if self.source is not None:
            figures["kd"] = out.kd.item()
        if self.z_loss:
            figures["z_loss"] = out.z.item()
        return out.loss, figures


def cross_entropy_objective(use_doc_mask: bool = False, chunk_tokens: int = 256, z_loss: float = 0.0) -> ChunkedObjective:
    """Next-token cross-entropy, chunked: `ChunkedObjective` without a source. Without a teacher a chunk
    holds one fp32 (chunk_tokens x vocab) tensor, and it peaks while every activation is still kept,
    so the chunk is small: 256 tokens are 48 MiB on a 49k vocabulary (4,096 were 768 MiB), and the
    head's matrix products stay large enough to run at full speed."""
    return ChunkedObjective(chunk_tokens=chunk_tokens, use_doc_mask=use_doc_mask, z_loss=z_loss)


def register_objective(section: str, builder: ObjectiveBuilder) -> None:
    """Train runs whose config has `section` set (e.g. "distill") with `builder`'s objective."""
    _BUILDERS[section] = builder


def build_objective(config: RunConfig, device: torch.device, previous: Optional[Objective] = None) -> Objective:
    """The objective of a run (or of one of its phases): a registered feature's when the config has
    its section, else cross-entropy."""
    if config.distill is None:
        return cross_entropy_objective(config.attention.doc_mask, z_loss=config.train.z_loss)
    if "distill" not in _BUILDERS:
        raise ConfigError("distill: this run distills, but no distillation objective is registered; "
                          "`import ropelab.distill` before calling train() (the ropelab CLI does)")
    return _BUILDERS["distill"](config, device, previous)


__all__ = ["Objective", "ObjectiveBuilder", "ChunkedObjective", "cross_entropy_objective", "register_objective",
           "build_objective"]
