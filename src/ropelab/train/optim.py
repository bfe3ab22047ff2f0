"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules (warm-up, then cosine or
warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ropelab.config import TrainConfig
from ropelab.position.registry import position_parameters


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW (one kernel over all parameters per step) takes these parameters:
    plain (not DTensor/FSDP-sharded) tensors on CPU or CUDA. On CPU it is several times faster than
    the default per-parameter loop (BENCHMARKS.md)."""
    return bool(params) and all(
        type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on parameters with 2+ dimensions (matrices, embeddings); none on norms, biases and
    learned position encodings (FoPE's coefficients: decay would pull them to 0, not to RoPE).
    Fused AdamW where `fused_supported`, else torch's default implementation."""
    exempt = position_parameters(model)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) not in exempt]
    no_decay = [p for p in model.parameters() if p.requires_grad and (p.dim() < 2 or id(p) in exempt)]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = fused_supported(decay + no_decay) or None
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, fused=fused)


def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now, as its first step would (AdamW: both moments zero, step 0):
    one step on zero gradients at learning rate 0, which leaves every parameter exactly as it was,
    then the step counts set back to 0. Does nothing when there is state already (a resumed run) or
    a parameter holds a gradient.

    Made before the first forward, the moments are in place before any activation; made lazily by
    the first step, they arrive when the first backward has just freed its activations, and on CPU
    the allocator often cannot reuse that memory for them: the first step then peaks above every
    later one (BENCHMARKS.md, "Real model")."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    set_lr(optimizer, 0.0)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    optimizer.zero_grad(set_to_none=True)


def warmup_steps(config: TrainConfig, total_steps: int | None = None) -> int:
    """Warm-up steps: `warmup_steps` when set, else `warmup_fraction` of the run's steps."""
    if config.warmup_steps is not None:
        return config.warmup_steps
    return int(round(config.warmup_fraction * (total_steps or config.steps)))


def lr_at(step: int, config: TrainConfig, total_steps: int | None = None) -> float:
    """The learning rate of 0-based `step` of `total_steps` (default `config.steps`): linear warm-up
    (`warmup_steps`) to `lr`, then by `schedule`
      cosine    cosine decay to lr * min_lr_ratio over the remaining steps;
      constant  `lr` to the end (a frontier's trunk: its cooldowns are branches, `ropelab.study.frontier`);
      wsd       warmup-stable-decay (Hägele et al. 2024; MHA2MLA, Ji et al. 2025): `lr` until the last
                `decay_fraction` of the steps, then down to lr * min_lr_ratio by `decay_shape` over the
                decay's progress p, from 0 at its first step (exactly lr) to 1 at the end (exactly the
                floor): 1-sqrt takes off (lr - floor) * sqrt(p), linear (lr - floor) * p.
    Steps past the end get lr * min_lr_ratio (cosine, wsd); a phase restarts its schedule (the trainer
    counts from its start)."""
    total = total_steps or config.steps
    warmup = warmup_steps(config, total)
    peak, floor = config.lr, config.lr * config.min_lr_ratio
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if config.schedule == "constant":
        return peak
    if config.schedule == "wsd":
        decay_start = max(warmup, total - max(1, int(round(config.decay_fraction * total))))
        if step < decay_start:
            return peak
        progress = (step - decay_start) / max(1, total - decay_start)
        if progress >= 1:
            return floor
        return peak - (peak - floor) * (math.sqrt(progress) if config.decay_shape == "1-sqrt" else progress)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
