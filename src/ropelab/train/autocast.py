"""The precision a run's forwards take: bf16 autocast per `train.precision` (`auto`: on CUDA only), its
matrix products as `train.bf16_gemm` says (`ropelab.precision`)."""

from __future__ import annotations

import torch

from ropelab.config import RunConfig
from ropelab.precision import mixed_precision


def uses_bf16(config: RunConfig, device: torch.device) -> bool:
    precision = config.train.precision
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(config: RunConfig, device: torch.device):
    return mixed_precision(device, uses_bf16(config, device), config.train.bf16_gemm)
