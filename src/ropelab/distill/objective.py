"""Training objectives with one call shape, so the trainer treats KD and plain cross-entropy alike:

    loss, figures = objective(model, batch, autocast_ctx)

`loss` is the differentiable mean over the batch's labelled tokens; `figures` are floats for the
metrics log: {"ce"} for cross-entropy, {"kd", "ce"} for distillation, plus "z_loss" (the mean
squared log-normaliser, unweighted) when `train.z_loss` is on. Both run the chunked `kd_loss`, so
neither materialises (tokens x vocab) logits for a whole window. `autocast_ctx` is optional: the
trainer may enter its autocast around the call instead.

  build_objective(config, device)   the run's objective: cross-entropy without `config.distill`,
                                    else KD from a live teacher or from `distill.logits_cache`
  DistillObjective(source, ...)     KD from a teacher source (`Teacher` or `CachedTeacher`: anything
                                    with ``targets(input_ids, position_ids, doc_ids, out_device)``)
  cross_entropy_objective(...)      next-token cross-entropy, the same objective without a teacher
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ropelab.config import DistillConfig, RunConfig
from ropelab.data.loader import Batch
from ropelab.distill.loss import kd_loss
from ropelab.train.distributed import unwrap


class DistillObjective:
    """KD from `source` mixed with cross-entropy as `config` says; cross-entropy alone when `source` is None.

    `use_doc_mask`: pass the batch's document ids to the student and the teacher (the trainer's
    `attention.doc_mask`). `z_loss`: weight of PaLM's logsumexp^2 regulariser (`train.z_loss`)."""

    def __init__(self, source, config: DistillConfig, use_doc_mask: bool = False, z_loss: float = 0.0):
        self.source = source
        self.config = config
        self.use_doc_mask = use_doc_mask
        self.z_loss = z_loss

    def __call__(self, model, batch: Batch, autocast_ctx=None) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.config
        doc_ids = batch.doc_ids if self.use_doc_mask else None
        targets = None
        if self.source is not None:
            targets = self.source.targets(batch.input_ids, batch.position_ids, doc_ids, out_device=batch.input_ids.device)
        with autocast_ctx if autocast_ctx is not None else contextlib.nullcontext():
            # through forward, so that DDP's and FSDP's hooks run; the head is applied chunk by chunk
            hidden, _ = model(batch.input_ids, None, batch.position_ids, doc_ids, return_hidden=True)
            out = kd_loss(hidden, unwrap(model).lm_head, batch.labels, targets, c.temperature, c.alpha, c.top_k,
                          c.chunk_tokens, self.z_loss)
        figures = {"ce": out.ce.item()}
        if self.source is not None:
            figures["kd"] = out.kd.item()
        if self.z_loss:
            figures["z_loss"] = out.z.item()
        return out.loss, figures


def cross_entropy_objective(use_doc_mask: bool = False, chunk_tokens: int = 4096, z_loss: float = 0.0) -> DistillObjective:
    """Next-token cross-entropy, chunked like KD: `DistillObjective` without a teacher."""
    config = DistillConfig(alpha=0.0, chunk_tokens=chunk_tokens)
    return DistillObjective(None, config, use_doc_mask, z_loss)


def build_objective(config: RunConfig, device: Optional[str | torch.device] = None, source=None) -> DistillObjective:
    """The objective of a run (or of one of its phases): cross-entropy when `config.distill` is None;
    KD from the offline cache when `distill.logits_cache` is set (the teacher is not loaded); else KD
    from the live teacher on `distill.teacher_device` ("auto": `device`, the student's). `source`: a
    teacher (or cache) already loaded, e.g. by the previous phase's objective (`objective.source`),
    used as is. Checks everything before returning."""
    use_doc_mask = config.attention.doc_mask
    z_loss = config.train.z_loss
    distill = config.distill
    if distill is None:
        return cross_entropy_objective(use_doc_mask, z_loss=z_loss)
    if source is None and distill.logits_cache:
        from ropelab.distill.cache import CachedTeacher

        source = CachedTeacher(distill.logits_cache, config)
    elif source is None:
        from ropelab.distill.teacher import load_teacher

        source = load_teacher(config, device if device is not None else "cpu")
    return DistillObjective(source, distill, use_doc_mask, z_loss)


__all__ = ["DistillObjective", "build_objective", "cross_entropy_objective"]
