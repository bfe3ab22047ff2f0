"""The distillation objective: KD from a teacher (live, or its cached targets) mixed with
cross-entropy, in the trainer's objective shape (`ropelab.train.objectives`).

  build_objective(config, device, previous)   the run's KD objective: from the offline cache when
                                              `distill.logits_cache` is set (the teacher is not
                                              loaded), else from the live teacher; the previous
                                              phase's teacher is reused when given
  DistillObjective(source, config, ...)       KD from a teacher source (`Teacher` or `CachedTeacher`)

Importing `ropelab.distill` registers `build_objective` with the trainer for runs with a `distill`
section.
"""

from __future__ import annotations

from typing import Optional

import torch

from ropelab.config import DistillConfig, RunConfig
from ropelab.distill.cache import CachedTeacher
from ropelab.distill.teacher import load_teacher
from ropelab.train.objectives import ChunkedObjective, Objective


class DistillObjective(ChunkedObjective):
    """KD from `source` mixed with cross-entropy as `config` (the run's `distill` section) says."""

    def __init__(self, source, config: DistillConfig, use_doc_mask: bool = False, z_loss: float = 0.0):
        super().__init__(source, config.temperature, config.alpha, config.top_k, config.chunk_tokens, use_doc_mask, z_loss)


def build_objective(config: RunConfig, device: Optional[str | torch.device] = None,
                    previous: Optional[Objective] = None) -> DistillObjective:
    """KD for `config` (a run or phase config with a `distill` section): from `previous`'s teacher
    when it had one, else from `distill.logits_cache`, else from the teacher loaded on
    `distill.teacher_device` ("auto": `device`, the student's). Checks everything before returning."""
    distill = config.distill
    source = getattr(previous, "source", None)
    if source is None and distill.logits_cache:
        source = CachedTeacher(distill.logits_cache, config)
    elif source is None:
        source = load_teacher(config, device if device is not None else "cpu")
    return DistillObjective(source, distill, config.attention.doc_mask, config.train.z_loss)


__all__ = ["DistillObjective", "build_objective"]
